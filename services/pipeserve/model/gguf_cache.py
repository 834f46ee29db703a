"""A GGUF file given as `--model FILE.gguf`: converted once into the cache, keyed by its content.

`cached_gguf(FILE)` returns the checkpoint directory
`$PIPESERVE_HOME/gguf/<xxh3-128 of the file>-c<CONVERTER_VERSION>`, converting the file
into it (model/gguf.py's `convert_gguf`) when it is not there yet. Every process then serves that
directory, like any checkpoint.

* The key is the file's content (xxh3-128, streamed in 16 MiB reads), not its name, size or date:
  another file under the same name is converted apart, the same file moved or copied is not
  converted again. And the converter's version (model/default.py): an older converter's output is
  never served.
* Reading a 40 GB file on every start would cost a minute: the digest is remembered per
  (path, size, mtime_ns, inode) in `gguf/digests/`; a file written again has another mtime and is
  read again.
* Converting is atomic (convert_gguf writes a temporary sibling and renames it), so a directory that
  exists is complete, and two processes converting at once both end with the same checkpoint.
* Both the hashing and the conversion show their progress: a bar on a terminal, else a log line
  every `progress_s` seconds (obs/progress.py).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import xxhash

from pipeserve.model.default import CONVERTER_VERSION, convert_once, pipeserve_home
from pipeserve.obs.progress import Progress

log = logging.getLogger("pipeserve.model")

GGUF_MAGIC = b"GGUF"  # the first four bytes of every GGUF file
_CHUNK = 16 << 20


def is_gguf(path: Path) -> bool:
    """A file that starts as a GGUF file does (whatever its name)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def file_digest(path: Path, progress_s: float = 2.0) -> str:
    """xxh3-128 of the file's bytes, hex."""
    h = xxhash.xxh3_128()
    with (
        open(path, "rb") as f,
        Progress(f"hashing {path.name}", path.stat().st_size, log, interval_s=progress_s) as p,
    ):
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            p.update(len(chunk))
    return h.hexdigest()


def content_key(path: Path, home: Path, progress_s: float = 2.0) -> str:
    """file_digest(path), remembered under the file's identity (path, size, mtime_ns, inode)."""
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    memo = home / "gguf" / "digests" / xxhash.xxh3_64_hexdigest(ident.encode())
    try:
        known, digest = memo.read_text().split("\n")[:2]
        if known == ident:
            return digest
    except (OSError, ValueError):
        pass
    digest = file_digest(path, progress_s)
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
    tmp.write_text(f"{ident}\n{digest}\n")
    os.replace(tmp, memo)  # atomic: a reader sees the old memo or the whole new one
    return digest


def cache_dir(digest: str, home: Path) -> Path:
    """Named by the content alone: the same file under another name or folder is found again."""
    return home / "gguf" / f"{digest}-c{CONVERTER_VERSION}"


def cached_gguf(path: str | Path, home: Path | None = None, progress_s: float = 2.0) -> Path:
    """The checkpoint directory of the GGUF file `path`, converted on first use."""
    src = Path(path)
    home = home or pipeserve_home()
    out = cache_dir(content_key(src, home, progress_s), home)
    if (out / "config.json").is_file():
        log.info("%s: the conversion in %s", src.name, out)
        return out
    return convert_once(src, out, progress_s)
