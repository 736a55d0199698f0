"""Write a tiny Llama-style model directory a real vLLM serves with `--load-format dummy` (no weights, no hub).

`python tiny_model.py DIRECTORY CONFIG_JSON`. The tokenizer is word-level over a closed vocabulary `w0`..`wN`, split
on whitespace: every word is exactly one token (its own leading space included), so a prompt of n words is n tokens,
and text the engine generates re-encodes to the same tokens. The chat template joins the messages' contents
with spaces and adds nothing, so a conversation's prompt is exactly the sum of its messages' words.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CHAT_TEMPLATE = "{% for message in messages %}{% if not loop.first %} {% endif %}{{ message['content'] }}{% endfor %}"


def build(directory: Path, config: dict) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {f"\u2581w{index}": index for index in range(config["vocab"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="\u2581w0"))
    # split on any run of whitespace first: text that already starts with a space (generated output) or holds two
    # spaces in a row still gives exactly one token a word
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")]
    )
    tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    # no special tokens at all: the engine generates any id, and a special one (an unk, an eos) would vanish from
    # the decoded text, which then re-encodes shorter than what was generated
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = config["max_model_len"]
    fast.save_pretrained(directory)
    heads, hidden = config["heads"], config["hidden"]
    model = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": config["layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": config["kv_heads"],
        "head_dim": hidden // heads,
        "vocab_size": config["vocab"],
        "max_position_embeddings": config["max_model_len"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": config["dtype"],
    }
    (directory / "config.json").write_text(json.dumps(model, indent=2) + "\n")
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}) + "\n")


if __name__ == "__main__":
    build(Path(sys.argv[1]), json.loads(sys.argv[2]))
