"""Convert a GGUF model file into a safetensors model directory.

``transformers`` reads a GGUF file (``from_pretrained(dir, gguf_file=...)``,
with the ``gguf`` package) and dequantizes it, but the model it returns
cannot be saved as it is ("quantized with gguf"). So a fresh model is built
from its config with ``quantization_config`` removed, the dequantized
weights are loaded into it, and that is saved, float32, with the tokenizer
(``tokenizer.json``, and the chat template as ``chat_template.jinja``). The
result loads through the normal ``from_pretrained`` path, with no GGUF.

transformers opens the GGUF file three times (config, tokenizer, weights;
parsing its 49,152-entry vocabulary each time) and builds the tensor-name
map once per tensor. Inside this one-shot process both are made once
(``_read_once``): converting the default model took 39 s here, now 17 s.
The fresh model is built on the meta device and takes the loaded tensors as
they are, so no random initialisation is computed only to be overwritten.

Run in a subprocess (the front-end never imports torch)::

    python -m trioserve.gpu.gguf_convert GGUF_FILE OUT_DIR

It writes into ``OUT_DIR`` (created); the caller makes that atomic.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import pathlib


def convert(gguf_file: str | pathlib.Path, out_dir: str | pathlib.Path) -> pathlib.Path:
    """Write ``gguf_file``'s model, dequantized to float32, as a safetensors
    directory at ``out_dir``; returns it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _read_once()
    source = pathlib.Path(gguf_file)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {"gguf_file": source.name}
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), **kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(str(source.parent), dtype=torch.float32, **kwargs)
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False, assign=True)
    # A tied output layer is shared with the embeddings, so it may be absent.
    if unexpected or any("lm_head" not in name for name in missing):
        raise RuntimeError(f"weights do not match the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    still_meta = [name for name, tensor in model.state_dict().items() if tensor.is_meta]
    if still_meta:
        raise RuntimeError(f"weights missing from the GGUF file: {still_meta}")
    model.generation_config = loaded.generation_config
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


def _read_once() -> None:
    """Make the ``gguf`` package's reader and tensor-name map once per
    argument in this process (transformers imports both from ``gguf`` when it
    needs them). The reader is a read-only view of the file, so sharing it is
    safe; if transformers ever stops looking them up there, only speed is lost."""
    import gguf

    if not hasattr(gguf.GGUFReader, "cache_info"):
        gguf.GGUFReader = functools.cache(gguf.GGUFReader)  # type: ignore[assignment,misc]  # a function now, not the class
        gguf.get_tensor_name_map = functools.cache(gguf.get_tensor_name_map)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m trioserve.gpu.gguf_convert",
        description="Convert a GGUF model file into a float32 safetensors model directory.",
    )
    parser.add_argument("gguf_file")
    parser.add_argument("out_dir", help="directory to write (created if missing)")
    args = parser.parse_args(argv)
    # transformers' GGUF reader draws its own tqdm bar (dozens of lines in the log of a serve that converts):
    # tqdm reads this when it is imported, so before transformers is.
    os.environ["TQDM_DISABLE"] = "1"
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    print(convert(args.gguf_file, args.out_dir))


if __name__ == "__main__":
    main()
