"""What the flow-matching transformer families (SD3, FLUX) share: schedule, LoRA, TP, PP order."""

from __future__ import annotations

from functools import cached_property

from torch import nn

from splitstage.pipelines.diffusers.base import DiffusersFamily
from splitstage.pipelines.diffusers.recipes import flow_scheduler

# diffusers' train_dreambooth_lora_sd3 / _flux defaults: attention of both streams.
MMDIT_LORA_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)
# Megatron-style: column-shard into heads / hidden units, row-shard what brings them back. Only the
# joint (two-stream) blocks: FLUX's single blocks concatenate attention and MLP before proj_out.
JOINT_BLOCK_TP = {
    "transformer_blocks.*.attn.to_q": "colwise",
    "transformer_blocks.*.attn.to_k": "colwise",
    "transformer_blocks.*.attn.to_v": "colwise",
    "transformer_blocks.*.attn.to_out.0": "rowwise",
    "transformer_blocks.*.attn.add_q_proj": "colwise",
    "transformer_blocks.*.attn.add_k_proj": "colwise",
    "transformer_blocks.*.attn.add_v_proj": "colwise",
    "transformer_blocks.*.attn.to_add_out": "rowwise",
    "transformer_blocks.*.ff.net.0.proj": "colwise",
    "transformer_blocks.*.ff.net.2": "rowwise",
    "transformer_blocks.*.ff_context.net.0.proj": "colwise",
    "transformer_blocks.*.ff_context.net.2": "rowwise",
}


def top_level_fqns(model: nn.Module) -> list[str]:
    """Children in registration order, ModuleLists expanded to `name.i` (the PP module order)."""
    fqns = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            fqns.extend(f"{name}.{index}" for index in range(len(child)))
        else:
            fqns.append(name)
    return fqns


class FlowTransformerFamily(DiffusersFamily):
    """A flow-matching transformer denoiser (`transformer`)."""

    denoiser = "transformer"
    default_lora_targets = MMDIT_LORA_TARGETS
    tp_plans = {"transformer": JOINT_BLOCK_TP}

    @cached_property
    def noise_scheduler(self):
        """FlowMatchEulerDiscreteScheduler from the folder's config (its sigma table)."""
        return flow_scheduler(self.scheduler_config)

    def tp_prepare(self, model: nn.Module, tp_degree: int) -> None:
        """Sharded attention holds heads / tp heads per rank: its processors read `attn.heads`."""
        for fqn, module in model.named_modules():
            if fqn.startswith("transformer_blocks.") and fqn.endswith(".attn"):
                module.heads = module.heads // tp_degree

    def pp_module_fqns(self, model: nn.Module) -> list[str]:
        """Embedders, the repeated blocks (FLUX: double- then single-stream), norm_out, proj_out."""
        return top_level_fqns(model)
