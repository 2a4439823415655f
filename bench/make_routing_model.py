"""A random-weights Llama for bench/routing.py, sized so that prefill dominates TTFT on one CPU.

The tiny model of scripts/make-tiny-model (hidden 128, 2 layers) is too small for prefill to
matter next to vLLM's own per-step overhead, so prefix caching would save nothing measurable.
This one is wider and deeper (hidden 512, 6 layers, 8 query heads over 4 KV heads, intermediate
1408: 18.4M parameters, 74 MB in float32): on one core under vLLM CPU a cold prefill of an
~800-token prompt takes ~400 ms, the same prompt plus one more turn with the prefix cached ~60 ms
(bench/routing.py measures both and prints them).

Tokenizer and chat template as the tiny model's: a byte-level BPE trained on a built-in
paragraph (bench/routing.py writes its prompts from the same words, so they tokenize to
~5 characters a token), `<s>role: content\\n...assistant:`. Special and non-printable tokens get
zero lm_head rows, so `max_tokens=N` always yields N tokens; `generation_config.json` is greedy
(`temperature: 0.0`, which vLLM honours). Offline, seeded, a few seconds; reruns with the same
generator and library versions are a no-op (stamp file).

Runs with the vLLM environment's Python (it has torch, transformers and tokenizers):

    .venvs/vllm/bin/python bench/make_routing_model.py [OUTDIR]    # default models/routing-llama
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "models" / "routing-llama"
GEN_VERSION = "routing-llama/1"  # bump on any change of the output
SEED = 4321
VOCAB_TARGET = 1024

# The model's shape (see the module docstring for why).
SHAPE: dict[str, int] = {
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
}

TEXT = """\
The quick brown fox jumps over the lazy dog. A cluster of nodes runs many jobs at once, and each
job asks the scheduler for cores, memory and accelerators. The serving plane starts language
model engines inside those jobs, waits until they answer on their health endpoint, and routes
requests from users to the engines that are ready. When a node fails, the scheduler requeues the
job and the router sends new traffic elsewhere. Tokens stream back one by one; a request ends
when the model has produced enough tokens or emits its end of sequence marker. Prefill reads the
prompt and fills the cache; decode writes one token at a time. Users send chat messages with a
role and content, and the server replies with a message from the assistant. A long document
about rivers, mountains, harbours and cities is shared by every turn of a conversation: the
engine keeps its keys and values in blocks, and a request whose prompt starts with blocks it has
seen before skips their computation. Routing by prefix sends the turns of one conversation to
the same replica, so that its cache is reused; routing in turn spreads them over every replica,
so that each one computes the document again. One, two, three, four, five, six, seven, eight,
nine, ten. Report, summary, question, answer, table.
"""
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


def words() -> list[str]:
    """The distinct words of the built-in text: bench/routing.py writes its prompts from them."""
    seen: dict[str, None] = {}
    for raw in TEXT.split():
        word = raw.strip(".,;:").lower()
        if word.isalpha():
            seen[word] = None
    return list(seen)


def stamp() -> str:
    source = Path(__file__).read_bytes()
    parts = [GEN_VERSION, hashlib.sha256(source).hexdigest()]
    parts += [f"{d}=={version(d)}" for d in ("transformers", "tokenizers", "torch", "safetensors")]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def byte_map() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: printable character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def build(out: Path) -> str:
    """Write the model into ``out`` (atomically); a one-line description."""
    # The vLLM environment's libraries, untyped here (the project's checks run in .venv).
    torch = importlib.import_module("torch")
    transformers = importlib.import_module("transformers")
    tokenizers = importlib.import_module("tokenizers")
    decoders, models = tokenizers.decoders, tokenizers.models
    pre_tokenizers, processors = tokenizers.pre_tokenizers, tokenizers.processors
    Tokenizer, trainers = tokenizers.Tokenizer, tokenizers.trainers
    GenerationConfig, LlamaConfig = transformers.GenerationConfig, transformers.LlamaConfig
    LlamaForCausalLM = transformers.LlamaForCausalLM
    FastTokenizer = transformers.PreTrainedTokenizerFast

    transformers.utils.logging.disable_progress_bar()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET,
        min_frequency=1,
        show_progress=False,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT] * 4, trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    fast = FastTokenizer(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=SHAPE["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    vocab = len(fast)

    cfg = LlamaConfig(
        vocab_size=vocab,
        **SHAPE,
        initializer_range=0.05,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(cfg).eval()
    params = sum(p.numel() for p in model.parameters())

    chars = byte_map()
    banned: list[int] = []
    for tid in range(vocab):
        if tid in fast.all_special_ids:
            banned.append(tid)
            continue
        try:
            text = bytes(chars[c] for c in fast.convert_ids_to_tokens(tid)).decode("utf-8")
        except (UnicodeDecodeError, KeyError):
            banned.append(tid)
            continue
        if not text or not all(ch.isprintable() for ch in text):
            banned.append(tid)
    with torch.no_grad():
        model.lm_head.weight[banned] = 0.0
    model.generation_config = GenerationConfig(
        do_sample=False,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
    )

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".routing-model-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        fast.save_pretrained(tmp)
        gc_path = tmp / "generation_config.json"
        gen: dict[str, Any] = json.loads(gc_path.read_text())
        gen["temperature"] = 0.0  # vLLM samples at 1.0 unless the config names a temperature
        gc_path.write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
        (tmp / "xhpc-routing-model.stamp").write_text(stamp() + "\n")
        tmp.chmod(0o755)
        for path in tmp.iterdir():
            path.chmod(0o644)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(p.stat().st_size for p in out.iterdir())
    shape = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in SHAPE.items())
    return (
        f"{params / 1e6:.1f}M parameters ({shape}; vocab {vocab}, {len(banned)} banned), "
        f"{size / 1e6:.0f} MB"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    for name, value in {
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TRANSFORMERS_VERBOSITY": "error",
    }.items():
        os.environ.setdefault(name, value)
    out: Path = args.out.resolve()
    t0 = time.monotonic()
    stamp_file = out / "xhpc-routing-model.stamp"
    if stamp_file.is_file() and stamp_file.read_text().strip() == stamp():
        print(f"make_routing_model: {out} up to date")
        return 0
    what = build(out)
    print(f"make_routing_model: wrote {out}: {what} in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
