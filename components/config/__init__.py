"""Config: typed sections (schema), loading with `key=value` overrides (loader)."""

from components.config.loader import fingerprint, flatten, load_config, parse_overrides
from components.config.schema import Config

__all__ = ["Config", "fingerprint", "flatten", "load_config", "parse_overrides"]
