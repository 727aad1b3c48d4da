"""Tiny random draft/target pairs, built locally (no hub), for tests and the quick benchmark.

They are saved with ``save_pretrained`` and a tokenizer made with the ``tokenizers`` library,
so they load through exactly the code path a user's model takes.

The draft is the target with Gaussian noise added to every weight: close enough that most
drafted tokens are accepted, far enough that rejections happen. Weights are initialised with a
large standard deviation so the distributions are peaked (like a trained model's) rather than
near-uniform, which keeps greedy decoding clear of near-ties.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TRAINING_TEXT = (
    """
The edge drafts a block of tokens and the cloud verifies the whole block in one pass.
Speculative decoding keeps the output distribution of the target model exactly.
A small model runs on the device; a large model runs in the data centre.
Tokens are accepted with probability min(1, p/q); a rejection draws from the residual.
def add(a, b):\n    return a + b\nprint(add(2, 3))
Les modèles de langue prédisent le prochain jeton. Ünïcödé, naïve café, 東京, emoji 🙂 too.
"""
    * 4
)


@dataclass(frozen=True)
class TinyPairSpec:
    """Shape of a tiny pair. Defaults give a ~0.3 M parameter model that runs in milliseconds."""

    vocab: str = "bpe"
    """"bpe": byte-level BPE (any UTF-8 text encodes); "letters": a 12-token word vocabulary
    for distribution tests that enumerate every outcome."""
    bpe_vocab_size: int = 384
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    init_std: float = 0.25
    logit_scale: float = 4.0
    """Multiplies the output layer so distributions are peaked (top-1 ~0.7 on average)."""
    draft_noise: float = 0.02
    """Relative noise added to the target's weights to make the draft (~75 % greedy agreement)."""
    seed: int = 0


def build_tokenizer(spec: TinyPairSpec) -> PreTrainedTokenizerFast:
    if spec.vocab == "letters":
        return _letters_tokenizer()
    if spec.vocab != "bpe":
        raise ValueError(f"unknown tiny vocabulary {spec.vocab!r} (bpe or letters)")
    return _bpe_tokenizer(spec.bpe_vocab_size)


def _bpe_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(), trainer=trainer)
    return _wrap(tokenizer)


def _letters_tokenizer() -> PreTrainedTokenizerFast:
    words = SPECIAL_TOKENS + list("abcdefghi")
    tokenizer = Tokenizer(models.WordLevel({word: index for index, word in enumerate(words)}, unk_token="a"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return _wrap(tokenizer)


def _wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_target(spec: TinyPairSpec, vocab_size: int, eos_token_id: int) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.hidden_size * 2,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=2048,
        initializer_range=spec.init_std,
        tie_word_embeddings=False,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
        dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(spec.logit_scale)
    model.generation_config.eos_token_id = eos_token_id
    return model


def perturbed_copy(target: Qwen2ForCausalLM, noise: float, seed: int) -> Qwen2ForCausalLM:
    draft = Qwen2ForCausalLM(target.config).eval()
    draft.load_state_dict(target.state_dict())
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for parameter in draft.parameters():
            scale = noise * parameter.std() if parameter.numel() > 1 else 0.0
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    draft.generation_config.eos_token_id = target.generation_config.eos_token_id
    return draft


def build_tiny_pair(directory: str | Path, spec: TinyPairSpec = TinyPairSpec()) -> tuple[Path, Path]:
    """Write ``directory/target`` and ``directory/draft`` (fp32 safetensors + tokenizer); return both."""
    directory = Path(directory)
    tokenizer = build_tokenizer(spec)
    eos_token_id = tokenizer.get_vocab()["<|im_end|>"]
    target = build_target(spec, len(tokenizer), eos_token_id)
    draft = perturbed_copy(target, spec.draft_noise, spec.seed)
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        path = directory / name
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]
