"""The command line's model options, under TRL's `ModelConfig` names (trl/trainer/model_config.py): how the model
is loaded (dtype, revision, attention, 4-bit / 8-bit quantization) and the LoRA adapter trained on it.

`grpokit train --use_peft --lora_r 16 --load_in_4bit` and the same keys in a YAML file do what TRL's CLI does with
them (trl.get_peft_config, trl.get_quantization_config); a YAML file may instead give `peft_config:` as a mapping
of peft.LoraConfig's arguments. Reading these options imports nothing heavy: peft and transformers load only when
the trainer is built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


def _about(help: str) -> dict:
    return {"help": help}


@dataclass
class ModelOptions:
    model_revision: str = field(default="main", metadata=_about("Model version: a branch, tag or commit id."))
    dtype: str | None = field(
        default=None,
        metadata=_about("dtype to load the model in: auto, bfloat16, float16, float32 (default: the model's own)."),
    )
    attn_implementation: str | None = field(
        default=None, metadata=_about("Attention implementation, e.g. sdpa, flash_attention_2.")
    )
    use_peft: bool = field(default=False, metadata=_about("Train a LoRA adapter instead of every weight (needs peft)."))
    lora_r: int = field(default=16, metadata=_about("LoRA rank."))
    lora_alpha: int = field(default=32, metadata=_about("LoRA alpha (the update is scaled by lora_alpha / lora_r)."))
    lora_dropout: float = field(default=0.05, metadata=_about("Dropout on the LoRA branch."))
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata=_about(
            "Modules to adapt, e.g. q_proj v_proj, or all-linear (default: peft's choice for the architecture)."
        ),
    )
    lora_target_parameters: list[str] | None = field(
        default=None, metadata=_about("Parameters to adapt (peft >= 0.17).")
    )
    lora_modules_to_save: list[str] | None = field(
        default=None, metadata=_about("Modules trained in full besides the adapter.")
    )
    lora_task_type: str = field(default="CAUSAL_LM", metadata=_about("peft task type."))
    use_rslora: bool = field(
        default=False, metadata=_about("Rank-stabilized LoRA: scale by lora_alpha / sqrt(lora_r).")
    )
    use_dora: bool = field(default=False, metadata=_about("DoRA: weight-decomposed LoRA."))
    load_in_8bit: bool = field(
        default=False, metadata=_about("Load the base model in 8 bits (bitsandbytes; with --use_peft).")
    )
    load_in_4bit: bool = field(
        default=False, metadata=_about("Load the base model in 4 bits, QLoRA (bitsandbytes; with --use_peft).")
    )
    bnb_4bit_quant_type: str = field(default="nf4", metadata=_about("4-bit type: nf4 or fp4."))
    use_bnb_nested_quant: bool = field(default=False, metadata=_about("Quantize the 4-bit quantization constants too."))
    bnb_4bit_quant_storage: str | None = field(default=None, metadata=_about("dtype the 4-bit weights are stored in."))

    def __post_init__(self):
        if self.load_in_8bit and self.load_in_4bit:
            raise ValueError("--load_in_8bit and --load_in_4bit: choose one.")
        if (self.load_in_8bit or self.load_in_4bit) and not self.use_peft:
            raise ValueError(
                "--load_in_4bit / --load_in_8bit quantize the base model, whose weights can then not be trained: add "
                "--use_peft to train a LoRA adapter on it (QLoRA)."
            )
        if self.bnb_4bit_quant_type not in ("nf4", "fp4"):
            raise ValueError(f"--bnb_4bit_quant_type {self.bnb_4bit_quant_type!r}: use nf4 or fp4.")

    def model_init_kwargs(self) -> dict:
        """from_pretrained's keyword arguments these options set (GRPOConfig.model_init_kwargs, saved with the run)."""
        kwargs = {}
        if self.model_revision != "main":
            kwargs["revision"] = self.model_revision
        if self.dtype is not None:
            kwargs["dtype"] = self.dtype
        if self.attn_implementation is not None:
            kwargs["attn_implementation"] = self.attn_implementation
        if self.load_in_4bit:  # TRL's get_quantization_config, as from_pretrained reads it from a dict
            kwargs["quantization_config"] = {
                "quant_method": "bitsandbytes",
                "load_in_4bit": True,
                "bnb_4bit_quant_type": self.bnb_4bit_quant_type,
                "bnb_4bit_use_double_quant": self.use_bnb_nested_quant,
                "bnb_4bit_compute_dtype": self.dtype if self.dtype not in (None, "auto") else "float32",
                **({"bnb_4bit_quant_storage": self.bnb_4bit_quant_storage} if self.bnb_4bit_quant_storage else {}),
            }
        elif self.load_in_8bit:
            kwargs["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
        return kwargs

    def lora_arguments(self) -> dict | None:
        """peft.LoraConfig's arguments (TRL's get_peft_config), or None without --use_peft."""
        if not self.use_peft:
            return None
        return {
            "task_type": self.lora_task_type,
            "r": self.lora_r,
            "target_modules": self.lora_target_modules,
            "lora_alpha": self.lora_alpha,
            "lora_dropout": self.lora_dropout,
            "bias": "none",
            "use_rslora": self.use_rslora,
            "use_dora": self.use_dora,
            "modules_to_save": self.lora_modules_to_save,
            **({"target_parameters": self.lora_target_parameters} if self.lora_target_parameters else {}),
        }


MODEL_OPTION_FIELDS = {f.name: f for f in dataclasses.fields(ModelOptions)}


def lora_config(arguments: dict):
    """peft.LoraConfig from its arguments (the --lora_* flags' or a YAML peft_config mapping's)."""
    from peft import LoraConfig

    arguments = {"task_type": "CAUSAL_LM", **arguments}
    target = arguments.get("target_modules")
    if target == ["all-linear"]:  # `--lora_target_modules all-linear`: peft takes the word itself, not a list
        arguments["target_modules"] = target[0]
    try:
        return LoraConfig(**arguments)
    except TypeError as error:
        raise ValueError(
            f"peft_config: {error} (peft.LoraConfig's arguments: r, lora_alpha, target_modules, ...)."
        ) from None
