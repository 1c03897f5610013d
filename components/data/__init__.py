"""Data: the arithmetic task generator, the GSM8K importer, the row schema, cleaning and samplers."""
