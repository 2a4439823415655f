"""A random-weight Llama of about ``--mb`` MB (float32) with the tiny model's tokenizer, for
bench/cache.py: big enough that reading it through the throttled mount takes seconds.

    .venvs/transformers/bin/python bench/_cache_model.py OUT --mb 200 \
        --tokenizer-from models/tiny-llama

Deterministic (seeded); skipped when OUT holds a model made with the same size and versions
(its stamp). Width 1024, the number of layers chosen to reach the size. Made in a temporary
directory beside OUT and renamed into place. Offline: the tokenizer and chat template are the
tiny model's files (scripts/make-tiny-model).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

HIDDEN = 1024
INTERMEDIATE = 2816
SEED = 4321
VERSION = "cache-llama/1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def layers_for(mb: float, vocab: int) -> int:
    """How many layers make about ``mb`` MB of float32 weights (at least 1)."""
    per_layer = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE + 2 * HIDDEN
    fixed = 2 * vocab * HIDDEN + HIDDEN
    return max(1, round((mb * 1e6 / 4 - fixed) / per_layer))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--mb", type=float, default=200.0)
    ap.add_argument("--tokenizer-from", type=Path, required=True)
    args = ap.parse_args()
    from importlib.metadata import version

    stamp = hashlib.sha256(
        "\n".join(
            [VERSION, f"mb={args.mb}"]
            + [f"{d}=={version(d)}" for d in ("transformers", "torch", "safetensors")]
        ).encode()
    ).hexdigest()
    stamp_file = args.out / "xhpc-cache-model.stamp"
    if stamp_file.is_file() and stamp_file.read_text().strip() == stamp:
        return 0
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(args.tokenizer_from)
    vocab = len(tok)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=layers_for(args.mb, vocab), num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=2048, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, dtype="float32",
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(cfg).eval()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".cache-model-", dir=args.out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        for name in TOKENIZER_FILES:
            if (args.tokenizer_from / name).is_file():
                shutil.copy(args.tokenizer_from / name, tmp / name)
        (tmp / "xhpc-cache-model.stamp").write_text(stamp + "\n")
        os.chmod(tmp, 0o755)
        for path in tmp.iterdir():
            os.chmod(path, 0o644)
        if args.out.exists():
            shutil.rmtree(args.out)
        os.rename(tmp, args.out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
