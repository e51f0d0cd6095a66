"""Builds a tiny Llama that vLLM can serve with no model hub: random weights, a locally trained
byte-level BPE tokenizer and a chat template.

The model generates noise, which is all an end-to-end test of routing needs: real vLLM
scheduling, batching, streaming, usage and metrics, on a model small enough for two CPU ranks
on one 2-core machine. Everything is seeded, so the same script writes the same files.

Usage: python tiny_model.py OUT_DIR [--moe]   (run with the vLLM venv's python)
  --moe  a Mixtral-shaped mixture of experts (4 experts, top 2) instead of the dense Llama.
"""

import argparse
import json
import random
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB = 2048
HIDDEN = 128
INTERMEDIATE = 256
LAYERS = 2
HEADS = 4
MAX_LEN = 8192
EXPERTS = 4
SEED = 20261203
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = (
    "the a rank token step barrier decode prefill request route gateway engine batch cache "
    "expert attention lockstep load queue wait time score group worker shim snapshot stream "
    "model prompt answer short long fast slow one two three four five six seven eight nine ten "
    "hello world data parallel sigma tick window finish start report usage chunk byte"
).split()


def corpus(lines: int = 20000):
    """Seeded sentences over a fixed vocabulary plus every printable ASCII character, so the
    byte-level tokenizer learns merges and still covers any input."""
    rng = random.Random(SEED)
    yield "".join(chr(c) for c in range(32, 127))
    for _ in range(lines):
        n = rng.randint(3, 16)
        words = [rng.choice(WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        yield " ".join(words) + rng.choice([".", "?", "!", ","])


def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def weights(moe: bool) -> dict:
    gen = torch.Generator().manual_seed(SEED)

    def w(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    t = {"model.embed_tokens.weight": w(VOCAB, HIDDEN), "model.norm.weight": ones(HIDDEN)}
    t["lm_head.weight"] = w(VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[f"{p}.self_attn.{proj}.weight"] = w(HIDDEN, HIDDEN)
        t[f"{p}.input_layernorm.weight"] = ones(HIDDEN)
        t[f"{p}.post_attention_layernorm.weight"] = ones(HIDDEN)
        if moe:
            t[f"{p}.block_sparse_moe.gate.weight"] = w(EXPERTS, HIDDEN)
            for e in range(EXPERTS):
                q = f"{p}.block_sparse_moe.experts.{e}"
                t[f"{q}.w1.weight"] = w(INTERMEDIATE, HIDDEN)
                t[f"{q}.w2.weight"] = w(HIDDEN, INTERMEDIATE)
                t[f"{q}.w3.weight"] = w(INTERMEDIATE, HIDDEN)
        else:
            t[f"{p}.mlp.gate_proj.weight"] = w(INTERMEDIATE, HIDDEN)
            t[f"{p}.mlp.up_proj.weight"] = w(INTERMEDIATE, HIDDEN)
            t[f"{p}.mlp.down_proj.weight"] = w(HIDDEN, INTERMEDIATE)
    return t


def config(tok: Tokenizer, moe: bool) -> dict:
    c = {
        "architectures": ["MixtralForCausalLM" if moe else "LlamaForCausalLM"],
        "model_type": "mixtral" if moe else "llama",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "head_dim": HIDDEN // HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_LEN,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": tok.token_to_id("<|begin_of_text|>"),
        "eos_token_id": tok.token_to_id("<|end_of_text|>"),
    }
    if moe:
        c.update(num_local_experts=EXPERTS, num_experts_per_tok=2, sliding_window=None)
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--moe", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer()
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|end_of_text|>",
                "pad_token": "<|end_of_text|>",
                "model_max_length": MAX_LEN,
                "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=1,
        )
    )
    cfg = config(tok, args.moe)
    (args.out / "config.json").write_text(json.dumps(cfg, indent=1))
    (args.out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]})
    )
    save_file(weights(args.moe), str(args.out / "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    main()
