"""Reading and atomically writing row files (parquet or jsonl)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from components.errors import DataError, OutputError

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa


def regular_file(path: str | Path, key: str, what: str = "a parquet or jsonl file") -> Path:
    """`path` as a regular file, checked without opening it (opening a FIFO would wait for a writer forever):
    DataError naming `key` when it is missing, or a FIFO, a device, a socket or a directory."""
    import stat

    p = Path(path)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        raise DataError(
            f"{key}: {p} does not exist. Run `reinforge prepare` (or `dvc repro`) to create it, "
            "or fix the path in your config."
        ) from None
    except OSError as exc:
        raise DataError(
            f"{key}: {p} cannot be read ({exc.strerror}); fix its permissions or the path."
        ) from None
    if not stat.S_ISREG(mode):
        kinds = (
            (stat.S_ISDIR, "a directory"),
            (stat.S_ISFIFO, "a FIFO (named pipe)"),
            (stat.S_ISSOCK, "a socket"),
        )
        kind = next((name for test, name in kinds if test(mode)), "a device")
        raise DataError(f"{key}: {p} is {kind}, not a regular file; give the path of {what}.")
    return p


def read_rows(path: str | Path, key: str = "data path") -> pd.DataFrame:
    """Rows of a parquet or jsonl file; a missing, irregular or unreadable file is a DataError naming it."""
    import pandas as pd  # here, not at the top: a worker writes checkpoints through this module, never rows
    import pyarrow.parquet as pq

    p = regular_file(path, key)
    try:
        if p.suffix in (".jsonl", ".json"):
            return pd.read_json(p, lines=p.suffix == ".jsonl", dtype=False)
        return pq.read_table(p).to_pandas()
    except Exception as exc:  # pyarrow and pandas raise many types for a bad file
        raise DataError(f"{key}: {p} could not be read as {p.suffix or 'parquet'}: {exc}") from None


def write_atomic(path: str | Path, write) -> Path:
    """Call write(tmp_path), fsync, then rename over `path`: readers never see a partial file. A failure of
    the disk (full, read-only, no permission) is an OutputError naming `path`; the previous file stays."""
    p = Path(path)
    tmp = None
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
        os.close(fd)
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except OSError as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise OutputError(
            f"cannot write {p}: {exc.strerror or exc} (errno {exc.errno}). Free space or fix the "
            "permissions there, or point the output elsewhere; the previous file is unchanged."
        ) from exc
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(p.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return p


def write_parquet(rows: list[dict], path: str | Path, schema: pa.Schema | None = None) -> Path:
    """Write dict rows as parquet, atomically; deterministic bytes for the same rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows, schema=schema)
    return write_atomic(path, lambda tmp: pq.write_table(table, tmp))


def write_json(obj, path: str | Path) -> Path:
    """Write JSON atomically (sorted keys, so equal content gives equal bytes)."""
    text = json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n"
    return write_atomic(path, lambda tmp: Path(tmp).write_text(text))


def to_plain(v):
    """numpy arrays and scalars from parquet -> plain Python (lists, dicts, str, numbers); NaN -> None."""
    if hasattr(v, "tolist"):
        return to_plain(v.tolist())
    if isinstance(v, dict):  # an image's encoded bytes (verl's {bytes, path}) stay bytes
        return {str(k): x if k == "bytes" and isinstance(x, bytes) else to_plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [to_plain(x) for x in v]
    if isinstance(v, bytes):
        return v.decode("utf-8", errors="backslashreplace")
    if isinstance(v, float) and v != v:
        return None
    return v
