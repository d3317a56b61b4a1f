"""A Megatron-core pipeline-parallel job under the Guard: 2 stages on 2 ranks, megatron's
``forward_backward_pipelining_without_interleaving`` over 4 micro-batches, in a
``Task(step_fn=...)`` (docs/guide/multirank.md, "Pipeline parallelism"). Runs on CPU ranks with
gloo (`nanbisect.integrations.megatron.on_cpu`).

    torchrun --nproc-per-node=2 examples/megatron_pipeline.py OUT
    nanbisect run OUT/step000002

Stage 0 embeds each position and scales it by the row's share of real tokens (divided by the
row's token count); stage 1 pools the positions and regresses a value. Megatron passes
[sequence, micro-batch, hidden] activations between the stages. At step 2, row 5 of the batch
(micro-batch 2 of 4, 2 rows each) is all padding: stage 0's forward divides 0 by 0, stage 1
receives the NaN, and the Guard writes one bundle for every rank.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig

import nanbisect
from nanbisect.integrations.megatron import on_cpu

MICRO_BATCHES, ROWS, SEQ, HIDDEN = 4, 2, 3, 8


class Embed(nn.Module):                                      # stage 0
    model_type = ModelType.encoder_or_decoder                # what megatron's schedules ask

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(4, HIDDEN)

    def set_input_tensor(self, tensor):                      # megatron's: none on stage 0
        pass

    def forward(self, x, mask):                              # x (S, B, 4), mask (S, B)
        m = mask.unsqueeze(-1)
        return torch.tanh(self.fc(x)) * m / m.sum(0)         # 0/0 for an all-padding row


class Head(nn.Module):                                       # stage 1
    model_type = ModelType.encoder_or_decoder

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(HIDDEN, 1)
        self.input_tensor = None

    def set_input_tensor(self, tensor):                      # what stage 0 sent
        self.input_tensor = tensor[0] if isinstance(tensor, list) else tensor

    def forward(self):
        return self.fc(self.input_tensor.sum(0)).squeeze(-1)  # (B,)


def task() -> nanbisect.Task:
    torch.manual_seed(0)
    if not parallel_state.model_parallel_is_initialized():     # (a replay builds it again)
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    # hidden_size: the activations' last dimension (megatron's p2p shape)
    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=1,
                               pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    first = parallel_state.is_pipeline_first_stage()
    model = Embed(config) if first else Head(config)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = get_forward_backward_func()

    def step(m, batch):
        """Megatron's 1F1B schedule over the batch's micro-batches; the mean of the
        micro-batches' losses on the last stage, None on the first."""
        micro = iter([{k: v[:, i * ROWS:(i + 1) * ROWS] if v.dim() > 1 else
                       v[i * ROWS:(i + 1) * ROWS] for k, v in batch.items()}
                      for i in range(MICRO_BATCHES)])

        def forward_step(data, model):
            b = next(data)
            out = model(b["x"], b["mask"]) if first else model()
            return out, lambda o: _loss(o, b["target"])

        with on_cpu(m):
            losses = schedule(forward_step_func=forward_step, data_iterator=micro, model=m,
                              num_microbatches=MICRO_BATCHES, seq_length=SEQ,
                              micro_batch_size=ROWS)
        return torch.stack([d["loss"] for d in losses]).mean() if losses else None

    return nanbisect.Task(model=model, optimizer=opt, step_fn=step)


def _loss(out, target):
    loss = (out - target).pow(2).mean()
    return loss, {"loss": loss.detach()}


def batch(step: int) -> dict:
    """Every rank's batch for ``step``, [sequence, rows] first: each stage takes what it uses."""
    g = torch.Generator().manual_seed(step)
    x, mask = torch.randn(SEQ, MICRO_BATCHES * ROWS, 4, generator=g), torch.ones(SEQ, 8)
    mask[2] = 0.0                                            # the last position is padding
    if step == 2:
        mask[:, 5] = 0.0                                     # row 5 (micro-batch 2): all padding
    return {"x": x, "mask": mask, "target": torch.randn(8, generator=g)}


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    guard = nanbisect.Guard(task(), entry=f"{os.path.abspath(__file__)}:task", out=out)
    try:
        for step in range(4):
            guard.step(batch(step))
    except nanbisect.NonFiniteStep as e:
        print(f"RANK {dist.get_rank()} BUNDLE {e.bundle}", flush=True)
    guard.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
