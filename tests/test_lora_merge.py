"""``merge_lora`` / ``ckptkit merge-lora`` against PEFT's own ``merge_and_unload()``.

The fixture (``fixtures/peft_lora``, written by ``fixtures/generators/peft_lora.py`` with PEFT
0.21.2 on CPU) holds a tiny Llama (float32 and bfloat16), two adapters PEFT saved, and the
SHA-256 of every tensor of PEFT's merged model. The merged output is read back with the
safetensors / torch loaders, never with ckptkit: PEFT's arithmetic is replayed, so equality
is bit for bit (no float32 rounding tolerance is needed, and none is granted).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckptkit
from ckptkit import tunables
from ckptkit.cli import main
from ckptkit.errors import FormatError, KeyNotFoundError, LimitExceededError
from ckptkit.ops.lora import UnsupportedAdapterError, merge_lora

from oracle import raw_bytes

FIXTURE = Path(__file__).parent / "fixtures" / "peft_lora"
REFERENCE = json.loads((FIXTURE / "reference" / "tensors.sha256.json").read_text())
#: The scaling PEFT gave each module, recorded by the generator from the live LoRA layers.
SCALINGS = json.loads((FIXTURE / "reference" / "item.json").read_text())["scalings"]
#: (reference case, base folder, adapter folder)
CASES = [
    ("plain", "base", "adapter_plain"),
    ("rslora", "base", "adapter_rslora"),
    ("plain_bf16", "base_bf16", "adapter_plain"),
]


def _sha(tensor: torch.Tensor) -> str:
    return hashlib.sha256(raw_bytes(tensor)).hexdigest()


def _spec(tensor: torch.Tensor) -> dict:
    dtype = str(tensor.dtype).removeprefix("torch.")
    return {"shape": list(tensor.shape), "dtype": dtype, "sha256": _sha(tensor)}


def _adapter_copy(tmp_path: Path, name: str, **changes) -> Path:
    """A copy of a fixture adapter with ``changes`` made to its adapter_config.json (a value
    of None removes the option)."""
    folder = tmp_path / f"{name}_edited"
    shutil.copytree(FIXTURE / name, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    for option, value in changes.items():
        if value is None:
            config.pop(option, None)
        else:
            config[option] = value
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder


@pytest.mark.parametrize(("case", "base", "adapter"), CASES, ids=[c[0] for c in CASES])
def test_merge_equals_peft_bit_for_bit(tmp_path, case, base, adapter):
    result = merge_lora(str(FIXTURE / base), str(FIXTURE / adapter), str(tmp_path / "out"))
    assert [f.name for f in result.files] == ["model.safetensors"]
    merged = load_file(tmp_path / "out" / "model.safetensors")
    expected = REFERENCE[f"{case}.safetensors"]
    assert sorted(merged) == sorted(expected)
    for key, tensor in merged.items():
        assert _spec(tensor) == expected[key], key

    # the reference is not the base: every merged tensor changed, every other one is the
    # base's, byte for byte
    original = load_file(FIXTURE / base / "model.safetensors")
    changed = {k.removeprefix("model.") for k in [*result.merged, *result.replaced]}
    assert changed == {k for k in merged if _sha(merged[k]) != _sha(original[k])}
    for key in merged.keys() - changed:
        assert raw_bytes(merged[key]) == raw_bytes(original[key]), key
    modules = {k.removeprefix("model.").removesuffix(".weight") for k in result.merged}
    assert modules == set(SCALINGS[case])


@pytest.mark.parametrize(
    ("case", "adapter"), [("plain", "adapter_plain"), ("rslora", "adapter_rslora")]
)
def test_scalings_are_peft_s(tmp_path, case, adapter):
    """lora_alpha / r, lora_alpha / sqrt(r) with use_rslora, rank_pattern and alpha_pattern
    (a plain name and a regex) per module, exactly as PEFT's live layers had them."""
    result = merge_lora(str(FIXTURE / "base"), str(FIXTURE / adapter), str(tmp_path / "out"))
    scalings = {
        k.removeprefix("model.").removesuffix(".weight"): s for k, s in result.merged.items()
    }
    assert scalings == SCALINGS[case]
    if case == "rslora":  # the patterns took effect: four distinct scalings besides the default
        assert len(set(scalings.values())) == 5
        assert result.replaced == ["model.lm_head.weight", "model.model.embed_tokens.weight"]


def test_delta_is_scaled_product(tmp_path):
    """With lora_alpha = r the scaling is 1: the merged tensor minus the base is B @ A, read
    from the adapter file with the safetensors loader."""
    adapter = _adapter_copy(tmp_path, "adapter_plain", lora_alpha=4)
    result = merge_lora(str(FIXTURE / "base"), str(adapter), str(tmp_path / "out"))
    assert set(result.merged.values()) == {1.0}
    merged = load_file(tmp_path / "out" / "model.safetensors")
    original = load_file(FIXTURE / "base" / "model.safetensors")
    weights = load_file(adapter / "adapter_model.safetensors")
    reference = REFERENCE["plain.safetensors"]
    for key in result.merged:
        name = key.removeprefix("model.")
        module = "base_model.model." + name.removesuffix(".weight")
        product = weights[f"{module}.lora_B.weight"] @ weights[f"{module}.lora_A.weight"]
        assert torch.equal(merged[name], original[name] + product), key
        assert _sha(merged[name]) != reference[name]["sha256"]  # scaling 3 there, 1 here


def test_fan_in_fan_out_transposes_the_delta(tmp_path):
    """A base storing its weights (in, out), as GPT-2's Conv1D does, with fan_in_fan_out:
    the merged tensors are PEFT's, transposed, bit for bit."""
    adapter = _adapter_copy(tmp_path, "adapter_plain", fan_in_fan_out=True)
    original = load_file(FIXTURE / "base" / "model.safetensors")
    targets = {k for k in original if k.endswith(("q_proj.weight", "v_proj.weight"))}
    transposed = {k: (v.T.contiguous() if k in targets else v) for k, v in original.items()}
    (tmp_path / "base").mkdir()
    save_file(transposed, tmp_path / "base" / "model.safetensors")
    merge_lora(str(tmp_path / "base"), str(adapter), str(tmp_path / "out"))
    merged = load_file(tmp_path / "out" / "model.safetensors")
    reference = REFERENCE["plain.safetensors"]
    for key, tensor in merged.items():
        expected = tensor.T.contiguous() if key in targets else tensor
        assert _sha(expected) == reference[key]["sha256"], key

    # with the base as PEFT saved it, v_proj (24 × 48) no longer fits a transposed delta
    with pytest.raises(FormatError, match=r"v_proj.*\(48, 24\) delta"):
        merge_lora(str(FIXTURE / "base"), str(adapter), str(tmp_path / "out2"))


def test_torch_output_and_dtype_cast(tmp_path):
    merge_lora(
        str(FIXTURE / "base"), str(FIXTURE / "adapter_rslora"), str(tmp_path / "pt"), to="torch"
    )
    state = torch.load(tmp_path / "pt" / "model.pt", weights_only=True)  # flat, like PEFT's
    expected = REFERENCE["rslora.safetensors"]
    assert sorted(state) == sorted(expected)
    for key, tensor in state.items():
        assert _spec(tensor) == expected[key], key

    merge_lora(
        str(FIXTURE / "base"), str(FIXTURE / "adapter_rslora"), str(tmp_path / "bf16"),
        dtype="bfloat16",
    )  # fmt: skip
    cast = load_file(tmp_path / "bf16" / "model.safetensors")
    for key, tensor in cast.items():
        assert raw_bytes(tensor) == raw_bytes(state[key].to(torch.bfloat16)), key


def test_torch_save_base_under_a_prefix(tmp_path):
    """A base ckptkit opens in another format, its model under another key (Lightning's
    ``state_dict.model.…``): the adapter's names are found under the prefix."""
    original = load_file(FIXTURE / "base" / "model.safetensors")
    torch.save({"state_dict": {f"model.{k}": v for k, v in original.items()}}, tmp_path / "x.ckpt")
    result = merge_lora(
        str(tmp_path / "x.ckpt"), str(FIXTURE / "adapter_rslora"), str(tmp_path / "out")
    )
    assert [f.name for f in result.files] == ["x.safetensors"]  # the file's group, as unshard
    assert all(k.startswith("x.state_dict.model.") for k in result.merged)
    merged = load_file(tmp_path / "out" / "x.safetensors")
    expected = REFERENCE["rslora.safetensors"]
    assert sorted(merged) == sorted(f"state_dict.model.{k}" for k in expected)
    for key, spec in expected.items():
        assert _spec(merged[f"state_dict.model.{key}"]) == spec, key


def test_base_without_an_adapted_tensor(tmp_path):
    original = load_file(FIXTURE / "base" / "model.safetensors")
    del original["model.layers.1.self_attn.v_proj.weight"]
    (tmp_path / "base").mkdir()
    save_file(original, tmp_path / "base" / "model.safetensors")
    with pytest.raises(
        KeyNotFoundError, match=r"model\.model\.layers\.1\.self_attn\.v_proj\.weight"
    ):
        merge_lora(str(tmp_path / "base"), str(FIXTURE / "adapter_plain"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize(
    ("changes", "option", "message"),
    [
        ({"use_dora": True}, "use_dora", "DoRA"),
        ({"peft_type": "IA3"}, "peft_type", "only LORA"),
        ({"bias": "lora_only"}, "bias", "trained biases"),
        ({"lora_bias": True}, "lora_bias", "lora_B biases"),
        ({"init_lora_weights": "mica"}, "init_lora_weights", "MiCA"),
        ({"target_parameters": ["mlp.experts.gate_up_proj"]}, "target_parameters", "Parameters"),
        ({"use_magic": True}, "use_magic", "unknown to ckptkit"),
        ({"rank_pattern": {"(q_proj)+": 2}}, "rank_pattern", "exponential time"),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_unsupported_options_are_refused_by_name(tmp_path, changes, option, message):
    adapter = _adapter_copy(tmp_path, "adapter_plain", **changes)
    with pytest.raises(UnsupportedAdapterError, match=message) as caught:
        merge_lora(str(FIXTURE / "base"), str(adapter), str(tmp_path / "out"))
    assert caught.value.option == option
    assert isinstance(caught.value, ckptkit.UnsupportedLayoutError)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"r": 5}, r"rank 4/4; the config gives it rank 5"),
        ({"r": "4"}, r"r must be a positive integer, not '4'"),
        ({"lora_alpha": True}, r"lora_alpha must be a finite number"),
        ({"use_rslora": "yes"}, r"use_rslora must be true or false"),
        ({"rank_pattern": {"v_proj": 0}}, r"rank_pattern\['v_proj'\] must be a positive integer"),
        ({"alpha_pattern": {"q_proj[": 3}}, r"alpha_pattern: pattern 'q_proj\['"),
        ({"modules_to_save": "lm_head"}, r"modules_to_save must be a list of names"),
    ],
)
def test_malformed_configs_are_refused(tmp_path, changes, message):
    adapter = _adapter_copy(tmp_path, "adapter_plain", **changes)
    with pytest.raises(FormatError, match=message):
        merge_lora(str(FIXTURE / "base"), str(adapter), str(tmp_path / "out"))


def test_rank_pattern_overrides_the_rank(tmp_path):
    """A rank_pattern entry whose rank disagrees with the saved pair is refused, naming the
    module: the pattern is matched as PEFT matches it (a dotted suffix)."""
    adapter = _adapter_copy(tmp_path, "adapter_plain", rank_pattern={"1.self_attn.v_proj": 2})
    with pytest.raises(FormatError, match=r"'model\.layers\.1\.self_attn\.v_proj'.*rank 2"):
        merge_lora(str(FIXTURE / "base"), str(adapter), str(tmp_path / "out"))
    # "v_proj" as a regex would match "xv_proj" too, but PEFT anchors it at a dot
    adapter = _adapter_copy(tmp_path / "b", "adapter_plain", rank_pattern={"_proj": 2})
    result = merge_lora(str(FIXTURE / "base"), str(adapter), str(tmp_path / "out"))
    assert set(result.merged.values()) == {3.0}


def test_unknown_adapter_tensors_are_named(tmp_path):
    """Without modules_to_save, the lm_head copy PEFT saved is a tensor it would not merge:
    an error naming it, never a silent drop."""
    adapter = _adapter_copy(tmp_path, "adapter_rslora", modules_to_save=None)
    with pytest.raises(FormatError, match=r"'adapter_model\.base_model\.model\.lm_head\.weight'"):
        merge_lora(str(FIXTURE / "base"), str(adapter), str(tmp_path / "out"))


def test_bad_config_files(tmp_path, monkeypatch):
    adapter = _adapter_copy(tmp_path, "adapter_plain")
    config = adapter / "adapter_config.json"
    text = config.read_text()
    config.write_text("[" * 100_000)
    with pytest.raises(FormatError, match="not valid JSON"):
        merge_lora(str(FIXTURE / "base"), str(adapter), str(tmp_path / "out"))
    config.write_text("[1, 2]")
    with pytest.raises(FormatError, match="a JSON object expected, not list"):
        merge_lora(str(FIXTURE / "base"), str(adapter), str(tmp_path / "out"))
    config.write_text(text)
    monkeypatch.setattr(tunables, "SMALL_FILE_LIMIT", 100)
    with pytest.raises(LimitExceededError, match="adapter_config.json"):
        merge_lora(str(FIXTURE / "base"), str(adapter), str(tmp_path / "out"))
    monkeypatch.undo()
    (adapter / "adapter_model.safetensors").unlink()
    with pytest.raises(ckptkit.MissingFileError, match="adapter_model.safetensors or"):
        merge_lora(str(FIXTURE / "base"), str(adapter), str(tmp_path / "out"))


def test_cli(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(
        ["merge-lora", str(FIXTURE / "base"), str(FIXTURE / "adapter_plain"), str(out), "--quiet"]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"wrote 1 file (212.0 KB) to {out}")
    assert "merged 4 LoRA pairs from" in printed and "(scaling 3)" in printed
    merged = load_file(out / "model.safetensors")
    assert {k: _spec(v) for k, v in merged.items()} == REFERENCE["plain.safetensors"]

    dora = _adapter_copy(tmp_path, "adapter_plain", use_dora=True)
    code = main(["merge-lora", str(FIXTURE / "base"), str(dora), str(tmp_path / "o2"), "--quiet"])
    assert code == 2
    assert "use_dora=True: DoRA" in capsys.readouterr().err
    # one folder, one checkpoint: a torch.save output beside the safetensors one is refused
    code = main(
        ["merge-lora", str(FIXTURE / "base"), str(FIXTURE / "adapter_plain"), str(out)]
        + ["--to", "torch", "--quiet"]
    )
    assert code == 2
    assert "already holds model.safetensors" in capsys.readouterr().err
