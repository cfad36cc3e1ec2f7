"""Unpickling stays bounded past the stand-ins (issue 24, rest of items 1 and 4).

Each case edits a real file written by torch here (a torch.save state dict with object entries,
a DCP checkpoint) or a checked-in fixture, then opens it in a fresh interpreter (the helpers of
``test_bounded_stand_ins``: a 1.5 GB address-space limit and a timeout):

* a pickle naming 150,000 distinct globals outside the allowlist is refused with a typed error
  naming the file, having cost a few MB, not the ~400 MB of 150,000 placeholder classes;
* placeholder classes are shared by two checkpoints holding the same global and collected once
  neither is alive (a notebook kernel does not accumulate them);
* an error a stand-in raises while unpickling names the file (and the key when known), once;
* DCP metadata whose chunk offsets, sizes or keys are deep shared lists is refused in bounded
  time before anything compares, multiplies or prints them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from byte_edits import unframed
from test_bounded_stand_ins import (
    DEEP,
    SHOWN,
    _edit_member,
    _open_limited,
    _sub_once,
)

from conformance_cases import FIXTURES

# --------------------------------------------------------------------------------------------
# Distinct unknown globals: bounded per pickle


def _state_with_step(tmp_path: Path, name: str, step: bytes) -> Path:
    """A torch.save state dict whose ``step`` (an int) becomes what the opcodes ``step`` build."""
    path = tmp_path / f"{name}.pt"
    torch.save({"w": torch.ones(3), "step": 7}, path)
    _edit_member(
        path, "/data.pkl", lambda data: _sub_once(rb"(X\x04\0\0\0stepq.)K\x07", step, data)
    )
    return path


def _state_with_globals(tmp_path: Path, count: int) -> Path:
    """``step`` a list naming ``count`` distinct globals outside the allowlist (GLOBAL opcodes,
    ~10 bytes each; no memo entries added, so the pickle's memo indices stay as they were)."""
    names = b"".join(b"cm\nC%d\n" % i for i in range(count))
    return _state_with_step(tmp_path, f"globals{count}", b"(" + names + b"l")


def _state_with_long_module(tmp_path: Path) -> Path:
    """``step`` a list of 3,000 globals of one 60 KB module name, memoized once (LONG_BINPUT
    at index 1000) and fetched for each (LONG_BINGET, a short name, STACK_GLOBAL)."""
    module = b"m" * 60_000
    index = (1000).to_bytes(4, "little")
    head = b"X" + len(module).to_bytes(4, "little") + module + b"r" + index + b"0("
    names = b"".join(b"j" + index + b"\x8c\x05C%04d\x93" % i for i in range(3000))
    return _state_with_step(tmp_path, "long_module", head + names + b"l")


#: Opens ``argv[1]`` under a 1.5 GB address-space limit, reporting how much the peak resident
#: memory grew while opening it and reading the key ``argv[2]`` (VmHWM: ``ru_maxrss`` would
#: start from the parent's peak).
_OPEN_MEASURED = """
import json, re, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1536 << 20, 1536 << 20))

def peak_kib():
    with open("/proc/self/status") as status:
        return int(re.search(r"VmHWM:\\s+(\\d+) kB", status.read()).group(1))

import ckptkit
before = peak_kib()
out = {}
try:
    step = ckptkit.open(sys.argv[1]).read_object(sys.argv[2])
    out["names"] = [item.global_name for item in step[:2]] + [len(step)]
except ckptkit.CheckpointError as exc:
    out.update(error=type(exc).__name__, message=str(exc))
out["grew_mib"] = (peak_kib() - before) / 1024
print(json.dumps(out))
"""


def _open_measured(path: Path) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", _OPEN_MEASURED, str(path), f"{path.stem}.step"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


#: case → (file maker, what the error says). Before the limits, 150,000 placeholder classes
#: took ~380 MB, and 3,000 placeholders named after one 60 KB module ~180 MB.
GLOBALS_CASES = {
    "150,000 distinct globals in 1.5 MB": (
        lambda tmp_path: _state_with_globals(tmp_path, 150_000),
        "more than 4096 distinct globals",
    ),
    "3,000 globals of a 60 KB module name": (
        _state_with_long_module,
        "a global named in 60005 characters (limit 4096)",
    ),
}


@pytest.mark.parametrize("case", list(GLOBALS_CASES))
def test_globals_beyond_the_limits_are_refused_in_bounded_memory(case, tmp_path):
    make, says = GLOBALS_CASES[case]
    path = make(tmp_path)
    assert path.stat().st_size < 2 << 20
    outcome = _open_measured(path)
    assert outcome.get("error") == "PickleLimitError", outcome
    message = outcome["message"]
    assert says in message, message
    assert message.count(str(path)) == 1, message  # named once
    assert outcome["grew_mib"] < 64, outcome


def test_globals_under_the_limit_load_as_placeholders(tmp_path):
    outcome = _open_measured(_state_with_globals(tmp_path, 1000))
    assert "error" not in outcome, outcome
    assert outcome["names"] == ["m.C0", "m.C1", 1000]


# --------------------------------------------------------------------------------------------
# Placeholder classes live as long as the values that use them

#: Opens ``argv[1]`` twice and reads placeholders from each, then drops the first checkpoint
#: and its values, then the second: the classes are shared while both live, collected after.
_PLACEHOLDER_LIFETIME = """
import gc, json, sys, weakref
import ckptkit
from ckptkit.decoding import placeholders

first = ckptkit.open(sys.argv[1])
second = ckptkit.open(sys.argv[1])
ratio, when = first.read_object("state.config.ratio"), first.read_object("state.config.when")
again = second.read_object("state.config.ratio")
alive = [weakref.ref(cls) for cls in placeholders._PLACEHOLDER_CLASSES.values()]
out = {
    "ratio": [type(ratio).global_name, list(ratio.args)],
    "shared": type(ratio) is type(again),
    "names": sorted(ref().global_name for ref in alive),
}
del first, ratio, when
gc.collect()
out["after_one"] = sum(ref() is not None for ref in alive)
del second, again
gc.collect()
out["after_both"] = sum(ref() is not None for ref in alive)
out["cached"] = len(placeholders._PLACEHOLDER_CLASSES)
print(json.dumps(out))
"""


def test_placeholder_classes_are_collected_with_the_checkpoint(tmp_path):
    import datetime
    import fractions

    path = tmp_path / "state.pt"
    config = {"ratio": fractions.Fraction(1, 3), "when": datetime.date(2024, 1, 2)}
    torch.save({"w": torch.ones(3), "config": config}, path)
    result = subprocess.run(
        [sys.executable, "-c", _PLACEHOLDER_LIFETIME, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout)
    assert outcome["ratio"] == ["fractions.Fraction", [1, 3]]
    assert outcome["names"] == ["datetime.date", "fractions.Fraction"]
    assert outcome["shared"]  # one class per global while in use: values compare across files
    assert outcome["after_one"] == 2  # the second checkpoint still uses them
    assert outcome["after_both"] == 0 and outcome["cached"] == 0


# --------------------------------------------------------------------------------------------
# Errors raised by stand-ins name the file


def _deepspeed_stage_7(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / "deepspeed"
    shutil.copytree(FIXTURES / "deepspeed_zero2_ws2" / "checkpoint", path)
    optim = path / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    stage = rb"(cdeepspeed.runtime.zero.config\nZeroStageEnum\nq.)K\x02"
    _edit_member(optim, "/data.pkl", lambda data: _sub_once(stage, b"K\x07", data))
    return path, "global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt"


def _numpy_shape_5(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / "numpy.pt"
    torch.save({"w": torch.ones(3), "a": np.zeros(3, dtype=np.float32)}, path)
    _edit_member(
        path,
        "/data.pkl",
        lambda data: _sub_once(rb"(cnumpy\nndarray\nq.)K\x00\x85", b"K\x05\x85", data),
    )
    return path, "numpy.pt"


#: case → (file maker, the file as the message names it; what the stand-in says).
STAND_IN_CASES = {
    "DeepSpeed ZeroStageEnum": (_deepspeed_stage_7, "ZeroStageEnum(7) is not a ZeRO stage 0..3"),
    "numpy _reconstruct": (_numpy_shape_5, "numpy array reconstructed with shape (5,), not (0,)"),
}


@pytest.mark.parametrize("case", list(STAND_IN_CASES))
def test_a_stand_in_error_names_the_file_once(case, tmp_path):
    make, says = STAND_IN_CASES[case]
    path, file = make(tmp_path)
    outcome = _open_limited(path)
    assert outcome.get("error") == "CorruptRecordError", outcome
    message = outcome["message"]
    assert message.endswith(f"{file}: {says}"), message
    assert message.count(file) == 1, message


def test_a_stand_in_error_in_a_dcp_object_names_the_file_and_key(tmp_path):
    """A DCP object record (a torch.save archive inside a ``.distcp``) edited in place: the
    error names the data file, the record's offset and the key. The edit keeps the length but
    not the zip member's CRC-32, hence ``verify_crc=False``."""
    import warnings

    import torch.distributed.checkpoint as dcp

    import ckptkit

    path = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"w": torch.ones(2), "arr": np.zeros(3, dtype=np.float32)}, checkpoint_id=path)
    data_file = path / "__0_0.distcp"
    data = _sub_once(rb"(cnumpy\nndarray\nq.)K\x00\x85", b"K\x05\x85", data_file.read_bytes())
    data_file.write_bytes(data)
    ckpt = ckptkit.open(str(path), verify_crc=False)
    with pytest.raises(ckptkit.CorruptRecordError) as caught:
        ckpt.read_object("arr")
    message = str(caught.value)
    assert message.endswith(
        "__0_0.distcp @0 (arr): numpy array reconstructed with shape (5,), not (0,)"
    ), message
    assert message.count("__0_0.distcp") == 1


# --------------------------------------------------------------------------------------------
# DCP metadata: nothing handed on unchecked

#: One ``torch.Size`` of two ints in the ``.metadata`` torch writes: BINGET torch.Size, the
#: ints, TUPLE2, MEMOIZE, TUPLE1, MEMOIZE, REDUCE, MEMOIZE.
_SIZE2 = rb"h.K.K.\x86\x94\x85\x94R\x94"
#: DEEP memoized three times, so the memo indices after it stay as they were.
_DEEP_MEMOIZED = DEEP + b"\x94\x94\x94"
#: ``([0], 10**12)``: ``math.prod`` of it repeats the list 10**12 times.
_REPEATED = b"(]K\x00a\x8a\x06\x00\x10\xa5\xd4\xe8\x00t" + b"\x94\x94\x94"


def _dcp_2x3(tmp_path: Path, *edits: tuple[bytes, bytes]) -> Path:
    """A DCP checkpoint of one 2x3 tensor ``w`` written by torch, its ``.metadata`` edited."""
    import warnings

    import torch.distributed.checkpoint as dcp

    path = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"w": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=str(path))
    data = unframed((path / ".metadata").read_bytes())
    for pattern, replacement in edits:
        data = _sub_once(pattern, replacement, data)
    (path / ".metadata").write_bytes(data)
    return path


_CHUNK_OFFSETS = rb"(\x8c\x07offsets\x94)" + _SIZE2
_CHUNK_SIZES = rb"(\x8c\x05sizes\x94)" + _SIZE2
_INDEX_OFFSET = rb"(\x8c\x06offset\x94)" + _SIZE2
_INDEX_FQN = rb"(\x8c\x03fqn\x94)h."

#: case → (edits of the metadata of ``{"w": 2x3 tensor}``, what the error says).
DCP_CASES = {
    "chunk and index offsets, two deep lists": (
        [(_CHUNK_OFFSETS, _DEEP_MEMOIZED), (_INDEX_OFFSET, _DEEP_MEMOIZED)],
        [f"tensor 'w' has a malformed chunk at {SHOWN}", "of size (2, 3) (not sequences of"],
    ),
    "chunk sizes, a deep list": (
        [(_CHUNK_SIZES, _DEEP_MEMOIZED)],
        [f"tensor 'w' has a malformed chunk at (0, 0) of size {SHOWN}"],
    ),
    "chunk sizes, a list times 10**12": (
        [(_CHUNK_SIZES, _REPEATED)],
        ["tensor 'w' has a malformed chunk at (0, 0) of size ([0], 1000000000000) (not"],
    ),
    "index offset, a deep list": (
        [(_INDEX_OFFSET, _DEEP_MEMOIZED)],
        [f"'w' has a record for no chunk ({SHOWN}"],
    ),
    "record key, a deep list": (
        [(_INDEX_FQN, DEEP)],
        [f".metadata: {SHOWN}", "has a malformed storage record"],
    ),
}


@pytest.mark.parametrize("case", list(DCP_CASES))
def test_dcp_metadata_with_deep_shared_lists_is_refused_fast(case, tmp_path):
    """Comparing two different lists that share their halves 80 deep takes 2**80 steps, as does
    printing one; ``math.prod`` of a list and a large int allocates the list that many times."""
    edits, says = DCP_CASES[case]
    outcome = _open_limited(_dcp_2x3(tmp_path, *edits))
    assert outcome.get("error") == "FormatError", outcome
    message = outcome["message"]
    assert all(part in message for part in says), message
    assert message.count(".metadata") == 1 and len(message) < 1000, message
    assert "MemoryError" not in outcome["cause"]
    assert outcome["seconds"] < 30
