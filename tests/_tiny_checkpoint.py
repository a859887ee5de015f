"""A tiny random Llama checkpoint with a word-level tokenizer, saved like a real one.

Shared by test_models.py and test_cli.py: the resolver, ``load_model`` and the CLI are tested
end to end on it in well under a second, with no network and no real weights.
"""

from __future__ import annotations

from pathlib import Path

WORDS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [f"w{i}" for i in range(99)]


def save_tiny_checkpoint(directory: Path, *, seed: int = 0) -> Path:
    """Write config, safetensors weights and a tokenizer (vocab 128) into ``directory``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for word in WORDS:
        vocab[word] = len(vocab)
    assert len(vocab) == 128
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>", pad_token="</s>")
    tokenizer.chat_template = ("{% for m in messages %}<s> {{ m['content'] }} </s>{% endfor %}"
                               "{% if add_generation_prompt %} a{% endif %}")

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(config).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
