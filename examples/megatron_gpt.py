"""A Megatron-core GPT under the Guard on 2 ranks (gloo, CPU): ``GPTModel`` with megatron's
local layer spec, tensor parallel (``tp``: its MLP and attention split column- and row-wise
across the ranks) or data parallel in megatron's ``DistributedDataParallel`` (``dp``: gradients in
its contiguous buffers, ``main_grad``), as `nanbisect.integrations.megatron.megatron_task` steps
it (docs/guide/integrations.md, "Megatron-core").

    torchrun --nproc-per-node=2 examples/megatron_gpt.py tp OUT      # or dp
    nanbisect run OUT/step000002

The MLP's activation is ``sqrt(x + 4)``. Before step 2, rank 1's MLP is corrupted (the bias of
its first projection set to -100, as a bad write to one rank's memory would): rank 1 takes the
root of a negative number in forward. With ``tp`` rank 0 receives the NaN through the
row-parallel all-reduce of ``linear_fc2``, with ``dp`` through the gradients' reduction.
"""
import os
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

import nanbisect
from nanbisect.integrations.megatron import megatron_task, on_cpu

VOCAB, SEQ, BATCH = 64, 8, 2


def activation(x):
    return torch.sqrt(x + 4.0)


def _task(tp: int) -> nanbisect.Task:
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                               tensor_model_parallel_size=tp, use_cpu_initialization=True,
                               activation_func=activation, hidden_dropout=0.0,
                               attention_dropout=0.0)
    with on_cpu():
        model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB,
                         max_sequence_length=SEQ)
        if tp == 1:         # data parallel: megatron's wrapper, its gradient buffers
            model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    return megatron_task(model, torch.optim.SGD(model.parameters(), lr=0.01), gpt_loss)


def tp() -> nanbisect.Task:
    return _task(2)


def dp() -> nanbisect.Task:
    return _task(1)


def gpt_loss(model, batch):
    """The mean of megatron's per-token cross entropy (vocab-parallel) over the batch."""
    tokens, labels = batch["tokens"], batch["labels"]
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    with on_cpu(model):
        losses = model(tokens, position_ids.to(tokens.device), None, labels=labels)        # (B, S)
    return losses.float().mean()


def batch(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def main() -> None:
    kind, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    t = globals()[kind]()
    guard = nanbisect.Guard(t, entry=f"{os.path.abspath(__file__)}:{kind}", out=out)
    try:
        for step in range(4):
            if step == 2 and dist.get_rank() == 1:      # rank 1's MLP shard goes bad
                with torch.no_grad():
                    gpt = t.model.module if kind == "dp" else t.model
                    gpt.decoder.layers[0].mlp.linear_fc1.bias.fill_(-100.0)
            guard.step(batch(step))
    except nanbisect.NonFiniteStep as e:
        print(f"RANK {dist.get_rank()} BUNDLE {e.bundle}", flush=True)
    guard.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
