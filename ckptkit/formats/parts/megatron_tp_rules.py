"""Megatron's parameter naming rules: how tensor parallelism splits each model parameter, and
its full (TP=1) shape from the model's sizes (:class:`ModelArgs`: Megatron-LM's saved ``args``,
NeMo's ``model_config.yaml``).

A legacy checkpoint (Megatron-LM ``--ckpt-format torch``, NeMo's ``mp_rank_XX`` archives) does
not save the split dimension (a Parameter attribute); every converter
in the field (Megatron's own ``tools/checkpoint/loader_legacy.py`` too) derives it from the
parameter's name, as here:

* column-parallel, split along dim 0 (weights and biases): the fused QKV (``linear_qkv`` /
  ``query_key_value``, laid out by query group, so a TP rank holds whole groups), the first MLP
  linear (``linear_fc1`` / ``dense_h_to_4h``), the word embeddings and the output layer (rows of
  the padded vocabulary);
* SwiGLU (``args.swiglu``): the first MLP linear is ``[gate; up]`` at TP=1 and each TP rank
  holds ``[gate_r; up_r]``: its two halves go to rows ``r·f`` and ``F + r·f`` (``f = F/TP``), as
  Megatron's ``apply_swiglu_sharded_factory`` and ``loader_legacy`` place them;
* row-parallel, weight split along dim 1: the attention output projection (``linear_proj`` /
  ``dense``) and the second MLP linear (``linear_fc2`` / ``dense_4h_to_h``); their biases are
  whole on every rank;
* replicated (whole on every rank): layer norms (mcore ``input_layernorm``,
  ``pre_mlp_layernorm``, TransformerEngine ``linear_qkv.layer_norm_weight``, legacy
  ``input_norm`` / ``post_attention_norm``, QK layernorm), the final norm, position embeddings.

Names outside these tables (MoE experts and routers, multi-latent attention, BERT heads…) have
no rule: the checkpoint is refused naming them, never merged by a guess.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from ...errors import FormatError

__all__ = [
    "EXTRA_STATE",
    "LAYER_KEY",
    "MegatronTPError",
    "ModelArgs",
    "Rule",
    "Split",
    "TIED_COPIES",
    "rule_for",
]

#: A layer's parameter: ``decoder.layers.3.mlp.linear_fc1.weight`` (mcore),
#: ``language_model.encoder.layers.3.mlp.dense_h_to_4h.weight`` (legacy).
LAYER_KEY = re.compile(
    r"^(?P<stack>decoder|language_model\.encoder)\.layers\.(?P<index>\d+)\.(?P<name>.+)$"
)
#: Modules' extra state (TransformerEngine fp8 metadata, ``None`` for mcore's own linears).
EXTRA_STATE = "_extra_state"
#: The last pipeline stage's own copy of tied word embeddings (PP > 1): legacy
#: ``word_embeddings_for_head``, mcore ``output_layer`` when the embeddings are tied.
TIED_COPIES = ("word_embeddings_for_head.weight", "output_layer.weight")


class MegatronTPError(FormatError):
    """A Megatron tensor-parallel model ckptkit will not merge: a parameter no naming rule
    covers, shapes that disagree with the model's sizes, ranks that disagree, a layout not
    supported. ``file`` and ``key`` name where (the rank file, the key in it)."""

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.file = file
        self.key = key


class Split(StrEnum):
    """How tensor parallelism holds a parameter."""

    COLUMN = "column-parallel (dim 0)"
    GATED = "column-parallel SwiGLU [gate; up] (dim 0, halves interleaved by rank)"
    ROW = "row-parallel (dim 1)"
    REPLICATED = "replicated"

    @property
    def dim(self) -> int | None:
        """The dimension TP splits (None: whole on every rank)."""
        return {Split.COLUMN: 0, Split.GATED: 0, Split.ROW: 1}.get(self)


@dataclass(frozen=True)
class ModelArgs:
    """What the model's sizes (Megatron-LM's saved ``args``, NeMo's model config) say about
    its shapes and parallelism."""

    tp: int
    pp: int
    num_layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    kv_channels: int
    vocab: int  # padded
    positions: int | None
    swiglu: bool
    tied: bool
    stage_layers: tuple[int, ...]  # layers on each pipeline stage

    @property
    def stage_offsets(self) -> tuple[int, ...]:
        """The global index of each stage's first layer."""
        return tuple(sum(self.stage_layers[:s]) for s in range(self.pp))


@dataclass(frozen=True)
class Rule:
    """A parameter's split and full shape (``what`` names the rule in messages)."""

    split: Split
    shape: tuple[int, ...]
    what: str


_Shape = Callable[[ModelArgs], tuple[int, ...]]


def _hidden(a: ModelArgs) -> tuple[int, ...]:
    return (a.hidden,)


def _kv(a: ModelArgs) -> tuple[int, ...]:
    return (a.kv_channels,)


def _qkv_rows(a: ModelArgs) -> int:
    return (a.heads + 2 * a.groups) * a.kv_channels


def _fc1_rows(a: ModelArgs) -> int:
    return 2 * a.ffn if a.swiglu else a.ffn


_NORMS = (
    "input_layernorm",  # mcore local
    "pre_mlp_layernorm",
    "input_norm",  # legacy
    "post_attention_norm",
    "post_attention_layernorm",  # older legacy (input_layernorm as mcore's)
)
#: Per-layer names (after ``layers.N.``): (split, full shape, what).
_LAYER_RULES: dict[str, tuple[Split, _Shape, str]] = {
    **{
        f"{n}.{p}": (Split.REPLICATED, _hidden, "layer norm")
        for n in _NORMS
        for p in ("weight", "bias")
    },
    **{
        f"{m}.layer_norm_{p}": (Split.REPLICATED, _hidden, "fused layer norm")
        for m in ("self_attention.linear_qkv", "mlp.linear_fc1")
        for p in ("weight", "bias")
    },
    **{
        f"self_attention.{q}_layernorm.{p}": (Split.REPLICATED, _kv, "QK layer norm")
        for q in ("q", "k")
        for p in ("weight", "bias")
    },
    **{
        f"self_attention.{m}.weight": (Split.COLUMN, lambda a: (_qkv_rows(a), a.hidden), "QKV")
        for m in ("linear_qkv", "query_key_value")
    },
    **{
        f"self_attention.{m}.bias": (Split.COLUMN, lambda a: (_qkv_rows(a),), "QKV bias")
        for m in ("linear_qkv", "query_key_value")
    },
    **{
        f"self_attention.{m}.weight": (
            Split.ROW,
            lambda a: (a.hidden, a.heads * a.kv_channels),
            "attention output projection",
        )
        for m in ("linear_proj", "dense")
    },
    **{
        f"self_attention.{m}.bias": (Split.REPLICATED, _hidden, "row-parallel bias")
        for m in ("linear_proj", "dense")
    },
    **{
        f"mlp.{m}.weight": (Split.COLUMN, lambda a: (_fc1_rows(a), a.hidden), "MLP fc1")
        for m in ("linear_fc1", "dense_h_to_4h")
    },
    **{
        f"mlp.{m}.bias": (Split.COLUMN, lambda a: (_fc1_rows(a),), "MLP fc1 bias")
        for m in ("linear_fc1", "dense_h_to_4h")
    },
    **{
        f"mlp.{m}.weight": (Split.ROW, lambda a: (a.hidden, a.ffn), "MLP fc2")
        for m in ("linear_fc2", "dense_4h_to_h")
    },
    **{
        f"mlp.{m}.bias": (Split.REPLICATED, _hidden, "row-parallel bias")
        for m in ("linear_fc2", "dense_4h_to_h")
    },
}
_FC1 = (
    "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias",
    "mlp.dense_h_to_4h.weight",
    "mlp.dense_h_to_4h.bias",
)


def _vocab(a: ModelArgs) -> tuple[int, ...]:
    return (a.vocab, a.hidden)


def _positions(a: ModelArgs) -> tuple[int, ...]:
    if a.positions is None:
        return ()  # no max_position_embeddings in args: no shape matches
    return (a.positions, a.hidden)


#: Names outside the layers.
_GLOBAL_RULES: dict[str, tuple[Split, _Shape, str]] = {
    **{
        f"{p}embedding.word_embeddings.weight": (Split.COLUMN, _vocab, "word embeddings")
        for p in ("", "language_model.")
    },
    **{
        f"{p}embedding.position_embeddings.weight": (
            Split.REPLICATED,
            _positions,
            "position embeddings",
        )
        for p in ("", "language_model.")
    },
    **{
        f"{n}.{p}": (Split.REPLICATED, _hidden, "final norm")
        for n in (
            "decoder.final_layernorm",
            "language_model.encoder.final_norm",
            "language_model.encoder.final_layernorm",
        )
        for p in ("weight", "bias")
    },
    **{
        name: (Split.COLUMN, _vocab, "output layer")
        for name in ("output_layer.weight", "language_model.output_layer.weight")
    },
    "word_embeddings_for_head.weight": (Split.COLUMN, _vocab, "tied word embeddings (head copy)"),
}


def rule_for(name: str, args: ModelArgs) -> Rule | None:
    """The rule of model key ``name`` (a layer's key without its stack and index, e.g.
    ``mlp.linear_fc1.weight``, when ``layer``; else the whole key); None when Megatron's
    naming has no rule for it."""
    layer = LAYER_KEY.match(name)
    table, local = (_LAYER_RULES, layer.group("name")) if layer else (_GLOBAL_RULES, name)
    found = table.get(local)
    if found is None:
        return None
    split, shape, what = found
    if layer and local in _FC1 and args.swiglu:
        split = Split.GATED
    if shape is _positions and args.positions is None:
        what += " (args has no max_position_embeddings)"
    return Rule(split, shape(args), f"{what}, {split.value}")
