"""LoRA for the torch backend (the run config's `lora` section), through PEFT.

Only the adapters train (the base weights stay frozen; the optimizer holds the adapters'
state alone). What leaves the trainer never shows PEFT's names:

- the engines get merged weights W + scale * B A under the base model's Hugging Face
  names (merged_named_parameters), computed without touching the model in place;
- the KL reference is the base model, i.e. the policy with its adapters disabled: no
  second model is loaded (backend.TorchBackend._reference_log_probs);
- a checkpoint holds the adapters in PEFT's own format (ADAPTER_WEIGHTS, ADAPTER_CONFIG,
  loadable by peft.PeftModel.from_pretrained) and names its base model in
  trainer_state.json (BASE_MODEL_STATE_KEY), from which a resume rebuilds the policy.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors.torch import load_file
from torch import Tensor, nn

from rlmesh.common import errors
from rlmesh.common.run_config import LoraConfig

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
BASE_MODEL_STATE_KEY = "lora_base_model_path"
_ADAPTER = "default"


def wrap(model: nn.Module, settings: LoraConfig, adapters_from: Path | None = None) -> nn.Module:
    """`model` with fresh LoRA adapters (B = 0: the policy starts as the base model), or
    the adapters saved in the checkpoint `adapters_from`."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from peft.utils import set_peft_model_state_dict

    targets = settings.target_modules if isinstance(settings.target_modules, str) else list(settings.target_modules)
    peft_config = PeftLoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        wrapped = get_peft_model(model, peft_config)
    except ValueError as e:  # target modules the model does not have
        raise errors.InvalidArgument(f"lora.target_modules: {e}") from None
    if adapters_from is not None:
        saved = adapters_from / ADAPTER_WEIGHTS
        if not saved.is_file():
            raise errors.InvalidArgument(f"{adapters_from}: a LoRA checkpoint without {ADAPTER_WEIGHTS}")
        try:
            result = set_peft_model_state_dict(wrapped, load_file(saved), adapter_name=_ADAPTER)
        except RuntimeError as e:  # another rank or other target shapes
            raise errors.InvalidArgument(f"{saved}: the adapters do not fit the run's lora settings: {e}") from None
        missing = [k for k in result.missing_keys if "lora_" in k]
        if missing:
            raise errors.InvalidArgument(
                f"{saved}: the adapters do not fit the run's lora settings (no weights for {missing[:3]}...)"
            )
    return wrapped.eval()


def _lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.get_base_model().named_modules() if isinstance(m, LoraLayer)}


def merged_named_parameters(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(base model's Hugging Face name, tensor) for every base parameter, in module order,
    LoRA-wrapped weights merged: W + get_delta_weight() = W + (alpha / rank) * B @ A."""
    layers = _lora_layers(model)
    for name, param in model.get_base_model().named_parameters():
        if ".lora_" in name:
            continue
        if ".base_layer." in name:
            owner, _, leaf = name.rpartition(".base_layer.")
            value = param.detach()
            if leaf == "weight":
                value = value + layers[owner].get_delta_weight(_ADAPTER).detach().to(value.dtype)
            yield f"{owner}.{leaf}", value
        else:
            yield name, param.detach()


def adapter_files(model: nn.Module) -> tuple[dict[str, Tensor], str]:
    """The adapters' tensors and config as PEFT writes them (save_pretrained)."""
    from peft.utils import get_peft_model_state_dict

    tensors = {k: v.detach() for k, v in get_peft_model_state_dict(model, adapter_name=_ADAPTER).items()}
    config = model.peft_config[_ADAPTER].to_dict()
    return tensors, json.dumps(config, indent=2, sort_keys=True, default=sorted)


@contextmanager
def dropout_active(model: nn.Module):
    """LoRA's dropout on, for the training passes only: the backend keeps the model in
    eval mode (the old and reference passes must be deterministic), which would turn a
    configured lora.dropout off. A model without adapters is left alone."""
    if not hasattr(model, "peft_config"):
        yield
        return
    dropouts = [m.lora_dropout for m in _lora_layers(model).values()]
    for d in dropouts:
        d.train()
    try:
        yield
    finally:
        for d in dropouts:
            d.eval()
