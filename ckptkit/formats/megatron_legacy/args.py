"""The model's shapes and parallelism from a legacy Megatron checkpoint's saved ``args``
(an ``argparse.Namespace``, as the safe unpickler returned it), as the shared naming rules
(:mod:`ckptkit.formats.parts.megatron_tp_rules`) take them."""

from __future__ import annotations

from typing import Any

from ...decoding.known_objects import decoded
from ..parts.megatron_tp_rules import ModelArgs
from .errors import MegatronLegacyError

__all__ = ["model_args"]


def model_args(args: Any, file: str, source: str, checkpoint_version: Any = None) -> ModelArgs:
    """The model's shapes and parallelism from the saved ``args`` Namespace (as the safe
    unpickler returned it) of rank file ``file`` (``source``: as messages name it); a
    :class:`MegatronLegacyError` naming them and the argument when one is missing or names a
    layout not supported (virtual pipeline, experts…)."""
    namespace = decoded(args)
    if not hasattr(namespace, "__dict__") or type(namespace).__name__ != "Namespace":
        raise MegatronLegacyError(
            f"{source}: 'args' is not an argparse.Namespace ({type(namespace).__name__}): "
            "the model's shapes cannot be checked",
            file=file,
            key="args",
        )
    values = vars(namespace)

    def number(name: str, default: int | None = None, *, positive: bool = True) -> int:
        value = values.get(name, default)
        if value is None:
            value = default
        if type(value) is not int or (positive and value <= 0):
            raise MegatronLegacyError(
                f"{source}: args.{name} is {value!r}, not a positive int"
                + (" (needed to check the model's shapes)" if name not in values else ""),
                file=file,
                key=f"args.{name}",
            )
        return value

    def refuse_if(name: str, why: str) -> None:
        value = values.get(name)
        if value not in (None, False, 0, 1, "", ()):
            raise MegatronLegacyError(
                f"{source}: args.{name} = {value!r}: {why} is not supported",
                file=file,
                key=f"args.{name}",
            )

    refuse_if("virtual_pipeline_model_parallel_size", "an interleaved (virtual) pipeline")
    refuse_if("expert_model_parallel_size", "expert parallelism")
    refuse_if("num_experts", "a mixture of experts")
    refuse_if("pipeline_model_parallel_layout", "a custom pipeline layout")
    refuse_if("account_for_embedding_in_pipeline_split", "a pipeline split counting embeddings")
    refuse_if("account_for_loss_in_pipeline_split", "a pipeline split counting the loss")
    tp = number("tensor_model_parallel_size", 1)
    version = checkpoint_version
    if tp > 1 and isinstance(version, int | float) and version < 2.0:
        raise MegatronLegacyError(
            f"{source}: checkpoint_version {version} stores QKV as [3, heads, head dim] per rank; "
            "merging tensor-parallel ranks of it is not supported",
            file=file,
            key="checkpoint_version",
        )
    pp = number("pipeline_model_parallel_size", 1)
    hidden = number("hidden_size")
    heads = number("num_attention_heads")
    num_layers = number("num_layers")
    groups = number("num_query_groups") if values.get("group_query_attention") else heads
    vocab = values.get("padded_vocab_size")
    if vocab is None and "orig_vocab_size" in values:
        multiple = number("make_vocab_size_divisible_by", 128) * tp
        vocab = -(-number("orig_vocab_size") // multiple) * multiple
    if vocab is None:
        number("padded_vocab_size")  # raises, naming it
    positions = values.get("max_position_embeddings")
    return ModelArgs(
        tp=tp,
        pp=pp,
        num_layers=num_layers,
        hidden=hidden,
        ffn=number("ffn_hidden_size", 4 * hidden),
        heads=heads,
        groups=groups,
        kv_channels=number("kv_channels", hidden // heads),
        vocab=number("padded_vocab_size", vocab),
        positions=positions if type(positions) is int else None,
        swiglu=values.get("swiglu") is True,
        tied=not values.get("untie_embeddings_and_output_weights", False),
        stage_layers=_stage_layers(values, num_layers, pp, file, source),
    )


def _stage_layers(
    values: dict[str, Any], num_layers: int, pp: int, file: str, source: str
) -> tuple[int, ...]:
    """Layers per pipeline stage as Megatron splits them: evenly, or with the first / last
    stage's count set (``decoder_first_pipeline_num_layers``, ``num_layers_in_first_pipeline_stage``
    and their ``last`` twins) and the rest split evenly."""
    first = values.get("decoder_first_pipeline_num_layers") or values.get(
        "num_layers_in_first_pipeline_stage"
    )
    last = values.get("decoder_last_pipeline_num_layers") or values.get(
        "num_layers_in_last_pipeline_stage"
    )
    if pp == 1:
        return (num_layers,)
    fixed = {0: first, pp - 1: last}
    fixed = {stage: n for stage, n in fixed.items() if type(n) is int and n >= 0}
    rest = num_layers - sum(fixed.values())
    middle = pp - len(fixed)
    if rest < 0 or (middle and rest % middle) or (not middle and rest):
        raise MegatronLegacyError(
            f"{source}: args split {num_layers} layers over {pp} pipeline stages "
            f"(first stage {first}, last stage {last}) unevenly: Megatron would refuse it",
            file=file,
            key="args.num_layers",
        )
    even = rest // middle if middle else 0
    return tuple(fixed.get(stage, even) for stage in range(pp))
