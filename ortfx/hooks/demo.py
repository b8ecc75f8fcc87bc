"""The convergence workflow on the demo model, with a divergence planted for the tools to find.

    python -m ortfx.hooks.demo [--out convergence-demo] [--second pytorch|ortfx]
        [--steps 6] [--plant-step 3] [--plant-block 2] [--overwrite]

Trains ``ortfx.demo.TinyGPT`` twice from the same weights and inputs, each run with a
``StatisticsSubscriber``: first in PyTorch (``<out>/pt``), then a second run (``<out>/second``)
in PyTorch or through ``ortfx.ORTModule`` in which, from step ``--plant-step`` on, the weight of
block ``--plant-block``'s second MLP layer is 0.1 % larger. Then merges the two
(``<out>/merged``) and prints ``divergence.txt``, which should name that step and that layer.
"""

from __future__ import annotations

import argparse
import copy
import shutil
from pathlib import Path

import torch

import ortfx
from ortfx.demo import TinyGPT
from ortfx.errors import OUTPUT_DIR_EXISTS, OrtfxOutputExistsError
from ortfx.hooks import GlobalSubscriberManager, StatisticsSubscriber
from ortfx.hooks.merge_activation_summary import merge


def train(
    model: torch.nn.Module,
    out: Path,
    *,
    steps: int,
    plant: tuple[int, torch.nn.Parameter] | None = None,
) -> list[float]:
    """Train ``steps`` SGD steps on fixed random batches, writing summaries into ``out``."""
    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(out)])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(0)
    losses = []
    for step in range(steps):
        ids = torch.randint(0, 512, (4, 32), generator=data)
        if plant is not None and step == plant[0]:
            with torch.no_grad():
                plant[1].mul_(1.001)
        opt.zero_grad()
        loss = model(ids, ids.roll(-1, dims=1))["loss"]
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    GlobalSubscriberManager.unsubscribe()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("convergence-demo"))
    parser.add_argument("--second", choices=["pytorch", "ortfx"], default="pytorch")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--plant-step", type=int, default=3)
    parser.add_argument("--plant-block", type=int, default=2)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.out.exists():
        if not args.overwrite:
            raise OrtfxOutputExistsError(
                OUTPUT_DIR_EXISTS.format(path=args.out, fix="pass --overwrite")
            )
        shutil.rmtree(args.out)

    torch.manual_seed(0)
    reference = TinyGPT(d=64, layers=4)
    second = copy.deepcopy(reference)
    target = second.blocks[args.plant_block].fc2.weight
    first_losses = train(reference, args.out / "pt", steps=args.steps)
    model = ortfx.ORTModule(second) if args.second == "ortfx" else second
    second_losses = train(
        model, args.out / "second", steps=args.steps, plant=(args.plant_step, target)
    )
    for step, (a, b) in enumerate(zip(first_losses, second_losses, strict=True)):
        print(f"step {step}: loss pytorch {a:.6f}  {args.second} {b:.6f}")
    merge(args.out / "pt", args.out / "second", args.out / "merged")
    print()
    print((args.out / "merged" / "divergence.txt").read_text(), end="")
    print(f"\nplot: {args.out / 'merged' / 'divergence.png'}")


if __name__ == "__main__":
    main()
