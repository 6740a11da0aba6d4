"""Fuzz ``trainer.read_checkpoint`` with mutated checkpoints for a fixed time.

Builds two valid checkpoints (a small tree with every kind of value, and a real trainer checkpoint:
model, Adam, StepLR, a stateful listener), then, until the time is up, applies one seeded random
mutation to one of them, writes the mutant to a file and reads it back. Every mutant must either
load to a tree equal to the original (same types, tensors with the same dtype, shape and bytes) or
be refused with a ``CheckpointFormatError`` whose message names the file. Anything else (another
exception type, a message without the file, a different tree) is a failure.

Mutations: byte flips anywhere, in the header or in the data; truncations; insertions; deletions;
a rewritten 8-byte header length; one JSON edit of the header, the tree or the checksums (a value
replaced, a key deleted or added); two tensors' offsets swapped; a dtype replaced; a splice of two
files.

Prints how many inputs were tried, loaded unchanged and refused, per mutation, and the most common
refusal messages (numbers and quoted names blanked). Exits 1 if any input failed.

Usage: python benchmarks/fuzz_checkpoint.py [--seconds 30] [--seed 0] [--messages 12]
       [--save-failures DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import pathlib
import random
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from trainer import CheckpointFormatError, Trainer, read_checkpoint, write_checkpoint

# -- valid inputs ---------------------------------------------------------------------------------


def small_tree() -> dict[str, Any]:
    weight = torch.arange(6.0).reshape(2, 3)
    return {
        "model": {"0.weight": weight, "0.bias": torch.tensor([0.5, -1.0, float("inf")])},
        "tied": weight,
        "ints": torch.tensor([3, -7], dtype=torch.int64),
        "half": torch.tensor([1.5, 2.0], dtype=torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(7, dtype=torch.int16),
        "empty": torch.zeros(0, 2),
        "counter": {3: 2, 1: 1},
        "values": [1, "x", None, True, 2.5, float("-inf")],
        "nested": {"names": ["a", "b"], "step": 12},
    }


class _Counter:
    def __init__(self) -> None:
        self.count = 0
        self.losses = torch.zeros(0)

    def on_batch_end(self, loss: torch.Tensor) -> None:
        self.count += 1
        self.losses = torch.cat([self.losses, loss.detach().reshape(1)])

    def on_save_checkpoint(self, checkpoint: Any) -> None:
        checkpoint["count"] = self.count
        checkpoint["losses"] = self.losses


def trainer_checkpoint(path: pathlib.Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    trainer = Trainer(max_epochs=1, device="cpu")
    trainer.subscribe(_Counter(), name="counter")
    data = [(torch.randn(4, 4), torch.randint(0, 3, (4,))) for _ in range(3)]

    def step(batch: Any) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])

    trainer.fit(model, optimizer, data, step, scheduler=scheduler)
    trainer.save_checkpoint(path)


# -- mutations ------------------------------------------------------------------------------------


def split(raw: bytes) -> tuple[dict[str, Any], bytes]:
    length = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def assemble(header: dict[str, Any], data: bytes) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data


def random_json(rng: random.Random, depth: int = 0) -> Any:
    choice = rng.randrange(9 if depth < 2 else 7)
    if choice == 0:
        return None
    if choice == 1:
        return rng.random() < 0.5
    if choice == 2:
        return rng.choice([0, 1, -1, 2**31, 2**64, -(2**70), rng.randrange(-1000, 1000)])
    if choice == 3:
        return rng.choice([0.5, -0.0, 1e308, float("inf"), float("nan")])
    if choice == 4:
        return "".join(rng.choice("ab.$/\\\n\x00é") for _ in range(rng.randrange(5)))
    if choice == 5:
        return rng.choice(["F32", "I64", "BOOL", "U8", "$tensor", "$intkeys", "model.0.weight"])
    if choice == 6:
        return rng.choice([[0, 0], [0, 4], [1], [2, 3], [-1, 8]])
    if choice == 7:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {rng.choice(["a", "$tensor", ""]): random_json(rng, depth + 1)}


def containers(value: Any) -> list[Any]:
    found = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            found.append(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            found.append(item)
            stack.extend(item)
    return found


def json_edit(rng: random.Random, document: Any) -> Any:
    target = rng.choice(containers(document))
    keys = list(target) if isinstance(target, dict) else list(range(len(target)))
    operation = rng.choice(["replace", "delete", "add"] if keys else ["add"])
    if operation == "add":
        if isinstance(target, dict):
            target[rng.choice(["x", "$tensor", "dtype", "__metadata__", ""])] = random_json(rng)
        else:
            target.insert(rng.randrange(len(target) + 1), random_json(rng))
    elif operation == "delete":
        del target[rng.choice(keys)]
    else:
        target[rng.choice(keys)] = random_json(rng)
    return document


def header_edit(rng: random.Random, raw: bytes) -> bytes:
    header, data = split(raw)
    metadata = header["__metadata__"]
    document = rng.choice(["header", "tree", "checksums"])
    if document == "header":
        header = json_edit(rng, header)
    else:
        metadata[document] = json.dumps(json_edit(rng, json.loads(metadata[document])))
    return assemble(header, data)


def _flip(rng: random.Random, raw: bytes, low: int, high: int, count: int) -> bytes:
    data = bytearray(raw)
    for _ in range(count):
        data[rng.randrange(low, high)] ^= rng.randrange(1, 256)
    return bytes(data)


def flip_anywhere(rng: random.Random, raw: bytes, _: bytes) -> bytes:
    return _flip(rng, raw, 0, len(raw), rng.randrange(1, 5))


def flip_header(rng: random.Random, raw: bytes, _: bytes) -> bytes:
    return _flip(rng, raw, 8, 8 + int.from_bytes(raw[:8], "little"), rng.randrange(1, 3))


def flip_data(rng: random.Random, raw: bytes, _: bytes) -> bytes:
    return _flip(rng, raw, 8 + int.from_bytes(raw[:8], "little"), len(raw), 1)


def truncate(rng: random.Random, raw: bytes, _: bytes) -> bytes:
    return raw[: rng.randrange(len(raw))]


def insert(rng: random.Random, raw: bytes, _: bytes) -> bytes:
    at = rng.randrange(len(raw) + 1)
    return raw[:at] + rng.randbytes(rng.randrange(1, 17)) + raw[at:]


def delete(rng: random.Random, raw: bytes, _: bytes) -> bytes:
    at = rng.randrange(len(raw))
    return raw[:at] + raw[at + rng.randrange(1, 17) :]


def header_length(rng: random.Random, raw: bytes, _: bytes) -> bytes:
    length = int.from_bytes(raw[:8], "little")
    new = rng.choice([max(0, length + rng.randrange(-16, 17)), rng.randrange(2**64)])
    return new.to_bytes(8, "little") + raw[8:]


def json_edit_mutation(rng: random.Random, raw: bytes, _: bytes) -> bytes:
    return header_edit(rng, raw)


def swap_offsets(rng: random.Random, raw: bytes, _: bytes) -> bytes:
    header, data = split(raw)
    names = [name for name in header if name != "__metadata__"]
    a, b = rng.sample(names, 2)
    header[a]["data_offsets"], header[b]["data_offsets"] = (
        header[b]["data_offsets"],
        header[a]["data_offsets"],
    )
    return assemble(header, data)


def set_dtype(rng: random.Random, raw: bytes, _: bytes) -> bytes:
    header, data = split(raw)
    name = rng.choice([name for name in header if name != "__metadata__"])
    header[name]["dtype"] = rng.choice(["F32", "I32", "U32", "F16", "BF16", "I16", "U8", "X"])
    return assemble(header, data)


def splice(rng: random.Random, raw: bytes, other: bytes) -> bytes:
    return raw[: rng.randrange(len(raw))] + other[rng.randrange(len(other)) :]


MUTATIONS: dict[str, Callable[[random.Random, bytes, bytes], bytes]] = {
    "flip": flip_anywhere,
    "flip-header": flip_header,
    "flip-data": flip_data,
    "truncate": truncate,
    "insert": insert,
    "delete": delete,
    "header-length": header_length,
    "json-edit": json_edit_mutation,
    "swap-offsets": swap_offsets,
    "set-dtype": set_dtype,
    "splice": splice,
}


# -- the oracle -----------------------------------------------------------------------------------


def same(a: Any, b: Any) -> bool:
    """Same types; tensors with equal dtype, shape and bytes; NaN equals NaN."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def message_shape(message: str, path: str) -> str:
    """A refusal message with the file, numbers and quoted values blanked, to count kinds."""
    shape = message.replace(path, "<file>")
    shape = re.sub(r"\((?:[^()]|\([^()]*\))*\)$", "(...)", shape)
    shape = re.sub(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", "'…'", shape)
    while True:  # innermost brackets first, so that nested lists and objects blank whole
        blanked = re.sub(r"[\[{][^\[\]{}]*[\]}]", "…", shape)
        if blanked == shape:
            break
        shape = blanked
    return re.sub(r"\d+", "N", shape)[:110]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-failures", type=pathlib.Path, default=None)
    parser.add_argument("--messages", type=int, default=12, help="refusal kinds to list")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rng = random.Random(args.seed)

    with tempfile.TemporaryDirectory() as folder:
        root = pathlib.Path(folder)
        write_checkpoint(root / "tree.safetensors", small_tree())
        trainer_checkpoint(root / "trainer.safetensors")
        bases = {}
        for name in ("tree", "trainer"):
            raw = (root / f"{name}.safetensors").read_bytes()
            bases[name] = (raw, read_checkpoint(root / f"{name}.safetensors"))
        target = root / "mutant.safetensors"

        counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        shapes: collections.Counter[str] = collections.Counter()
        failures: list[tuple[str, bytes, str]] = []
        started = time.perf_counter()
        while time.perf_counter() - started < args.seconds:
            base = rng.choice(sorted(bases))
            raw, expected = bases[base]
            other = bases["trainer" if base == "tree" else "tree"][0]
            mutation = rng.choice(sorted(MUTATIONS))
            mutant = MUTATIONS[mutation](rng, raw, other)
            target.write_bytes(mutant)
            try:
                tree = read_checkpoint(target)
            except CheckpointFormatError as exc:
                if str(target) in str(exc):
                    counts[mutation]["refused"] += 1
                    shapes[message_shape(str(exc), str(target))] += 1
                    continue
                outcome = f"message without the file: {exc}"
            except Exception:
                outcome = traceback.format_exc(limit=-3)
            else:
                if same(tree, expected):
                    counts[mutation]["loaded"] += 1
                    continue
                outcome = "loaded a tree that differs from the original"
            counts[mutation]["failed"] += 1
            failures.append((f"{base}/{mutation}", mutant, outcome))
        elapsed = time.perf_counter() - started

    total = collections.Counter()
    for counter in counts.values():
        total.update(counter)
    tried = sum(total.values())
    print(f"fuzz_checkpoint: {tried} inputs in {elapsed:.1f} s (seed {args.seed})")
    print(f"  loaded unchanged: {total['loaded']}")
    print(f"  refused cleanly:  {total['refused']}")
    print(f"  failures:         {total['failed']}")
    print(f"  {'mutation':<14} {'tried':>7} {'loaded':>7} {'refused':>8} {'failed':>7}")
    for mutation in sorted(counts):
        c = counts[mutation]
        print(
            f"  {mutation:<14} {sum(c.values()):>7} {c['loaded']:>7} {c['refused']:>8} "
            f"{c['failed']:>7}"
        )
    print("  most common refusals:")
    for shape, count in shapes.most_common(args.messages):
        print(f"  {count:>7}  {shape}")
    print(f"  {len(shapes)} distinct refusal messages (numbers and names blanked)")
    for label, mutant, outcome in failures[:5]:
        print(f"FAILED {label} ({len(mutant)} bytes): {outcome}", file=sys.stderr)
    if failures and args.save_failures is not None:
        args.save_failures.mkdir(parents=True, exist_ok=True)
        for i, (label, mutant, _) in enumerate(failures):
            name = f"{i:04d}-{label.replace('/', '-')}.safetensors"
            (args.save_failures / name).write_bytes(mutant)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
