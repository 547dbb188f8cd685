"""Convert a GGUF checkpoint once into an HF safetensors directory.

Run as `python -m workers.model_cache GGUF TARGET`; concurrent converters
serialize on a lock file, and the result appears atomically by rename.
"""

from __future__ import annotations

import fcntl
import shutil
import sys
import tempfile
from pathlib import Path


def convert(gguf: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "model.safetensors").exists():
            return
        print(f"converting {gguf.name} to safetensors in {target} (once)", file=sys.stderr)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # transformers refuses to save a GGUF-loaded model while its quantizer is attached;
        # the weights are already dequantized, so the saved copy is a plain checkpoint.
        model.hf_quantizer = None
        if getattr(model.config, "quantization_config", None) is not None:
            del model.config.quantization_config
        scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        if target.exists():
            shutil.rmtree(target)
        scratch.rename(target)


if __name__ == "__main__":
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
