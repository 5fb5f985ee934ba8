#!/usr/bin/python3
"""Make a detached job of the README's byte-level GPT: the daemon trains it on its own, with no
client attached (docs/detached.md).

    PYTHONPATH=python_client /usr/bin/python3 examples/detached_gpt.py /tmp/gpt-job
    bazel-bin/daemon/ranncd --devices cpu:2 &
    bazel-bin/client/rannc submit /tmp/gpt-job/job.toml --follow

This writes, into the directory given: the model traced as (input_ids, targets) -> loss
(model.pt), the text as byte tokens (train.bin, and the last 5% as val.bin), and job.toml,
which names them with train_gpt.py's training: AdamW, warmup then cosine decay, a held-out
evaluation every 50 steps. Ctrl-C on `submit --follow` detaches; `rannc status JOB` and
`rannc logs JOB -f` find the job again, `rannc cancel JOB` stops it.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import ByteGPT, add_training_arguments, load_text  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the directory to write the job into")
    add_training_arguments(ap)
    args = ap.parse_args()

    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    raw = load_text(args.data)
    split = int(len(raw) * 0.95)
    with open(os.path.join(args.out, "train.bin"), "wb") as f:
        f.write(raw[:split])
    with open(os.path.join(args.out, "val.bin"), "wb") as f:
        f.write(raw[split:])

    model = ByteGPT(args.layers, args.dim, args.heads, args.seq, dropout=0.0)
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long)
    torch.jit.trace(model, (ids, ids)).save(os.path.join(args.out, "model.pt"))

    with open(os.path.join(args.out, "job.toml"), "w") as f:
        f.write(f'''name = "byte-gpt"
model = "model.pt"
tokens = "train.bin"
token_dtype = "uint8"
eval_tokens = "val.bin"
batch = {args.batch}
seq = {args.seq}
steps = {args.steps}
seed = {args.seed}
eval_every = 50
eval_batches = 8

[optimizer]
type = "adamw"
lr = {args.lr}
betas = [0.9, 0.95]
weight_decay = 0.01

[schedule]
kind = "cosine"
warmup_steps = {max(1, args.steps // 10)}
min_lr = 0.0
''')
    print(f"wrote {args.out}/job.toml ({len(raw) / 1e3:.0f} kB of text, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters); submit it with\n"
          f"  bazel-bin/client/rannc submit {args.out}/job.toml --follow")


if __name__ == "__main__":
    main()
