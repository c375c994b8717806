"""Checkpoints of ``fusetrain train`` in Python.

A trainer checkpoint is a ``dict`` of tensors that ``torch.load`` reads
(``weights_only=True`` included): ``model.<name>`` holds the parameters and
buffers, ``optim.*`` the optimizer state, ``scaler.*`` the loss scaler,
``trainer.*`` the step and data position, ``rng.*`` the random state,
``data.mean``/``data.std`` the input normalisation and ``config.yaml`` the
resolved run configuration (text stored as a uint8 tensor).

``load_model`` rebuilds the trained network as an ordinary ``torch.nn.Module``
(``mlp`` and ``cnn``, with the C++ models' parameter names and shapes) that
gives the trainer's predictions::

    from fusetrain.load_checkpoint import load_model, preprocess
    model = load_model("runs/fashion_mnist-20250101-120000/checkpoints/step_00003744.pt")
    logits = model(preprocess(images_uint8, model))   # images [N, 28, 28] or [N, 1, 28, 28]

From a shell, ``python -m fusetrain.load_checkpoint PATH`` prints what a
checkpoint holds.
"""

from __future__ import annotations

import argparse
import sys
from typing import Dict, List

import torch
from torch import nn

__all__ = ["load_checkpoint", "checkpoint_config", "build_model", "load_model", "preprocess", "main"]


def load_checkpoint(path: str) -> Dict[str, torch.Tensor]:
    """The checkpoint's tensors, on the CPU."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(ckpt, dict) or "config.yaml" not in ckpt:
        raise ValueError(f"{path} is not a checkpoint written by fusetrain train (no config.yaml entry)")
    return ckpt


def _text(t: torch.Tensor) -> str:
    return bytes(t.to(torch.uint8).tolist()).decode("utf-8")


def _parse_scalar(text: str):
    text = text.strip()
    if text.startswith('"') and text.endswith('"'):
        return text[1:-1].encode("utf-8").decode("unicode_escape")
    if text.startswith("[") and text.endswith("]"):
        return [_parse_scalar(x) for x in text[1:-1].split(",") if x.strip()]
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _parse_config(text: str) -> Dict[str, Dict[str, object]]:
    try:
        import yaml  # noqa: PLC0415  (optional: the trainer's YAML is simple enough without it)

        return yaml.safe_load(text)
    except ImportError:
        pass
    # The trainer writes sections of "key: value" lines, lists in flow style.
    config: Dict[str, Dict[str, object]] = {}
    section = None
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line.startswith(" "):
            section = line.rstrip(":").strip()
            config[section] = {}
        else:
            key, _, value = line.strip().partition(":")
            config[section][key.strip()] = _parse_scalar(value)
    return config


def checkpoint_config(ckpt: Dict[str, torch.Tensor]) -> Dict[str, Dict[str, object]]:
    """The run configuration stored in the checkpoint: ``{section: {key: value}}``."""
    return _parse_config(_text(ckpt["config.yaml"]))


class Mlp(nn.Module):
    """The trainer's ``mlp``: flatten, [linear, ReLU] per hidden size, optional dropout, head."""

    def __init__(self, input_shape: List[int], hidden: List[int], dropout: float, classes: int):
        super().__init__()
        n = 1
        for s in input_shape:
            n *= s
        layers: List[nn.Module] = [nn.Flatten()]
        for h in hidden:
            layers += [nn.Linear(n, h), nn.ReLU()]
            n = h
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(n, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


class Cnn(nn.Module):
    """The trainer's ``cnn``: per channel count a block of 3x3 conv (no bias),
    batch norm, ReLU and 2x2 max pooling; then flatten, [linear, ReLU] per
    hidden size, optional dropout, and the head."""

    def __init__(self, input_shape: List[int], channels: List[int], hidden: List[int], dropout: float,
                 classes: int):
        super().__init__()
        c, h, w = input_shape
        features: List[nn.Module] = []
        for ch in channels:
            features += [nn.Conv2d(c, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch), nn.ReLU(), nn.MaxPool2d(2)]
            c, h, w = ch, h // 2, w // 2
        self.features = nn.Sequential(*features)
        n = c * h * w
        classifier: List[nn.Module] = [nn.Flatten()]
        for size in hidden:
            classifier += [nn.Linear(n, size), nn.ReLU()]
            n = size
        if dropout > 0:
            classifier.append(nn.Dropout(dropout))
        self.classifier = nn.Sequential(*classifier)
        self.head = nn.Linear(n, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.classifier(self.features(x)))


def _input_shape(config) -> List[int]:
    data = config["data"]
    if data["name"] == "fashion_mnist":
        return [1, 28, 28]
    if data["name"] == "synthetic_images":
        return [int(data["channels"]), int(data["image_size"]), int(data["image_size"])]
    raise ValueError(f"data.name={data['name']} is token data; load_model rebuilds image models (mlp, cnn)")


def _as_list(v) -> List[int]:
    return [int(x) for x in (v if isinstance(v, list) else [v])]


def build_model(config) -> nn.Module:
    """An untrained ``mlp`` or ``cnn`` as the run configuration describes it."""
    model = config["model"]
    classes = 10 if config["data"]["name"] == "fashion_mnist" else int(config["data"]["num_classes"])
    if model["name"] == "mlp":
        return Mlp(_input_shape(config), _as_list(model["hidden"]), float(model["dropout"]), classes)
    if model["name"] == "cnn":
        return Cnn(_input_shape(config), _as_list(model["channels"]), _as_list(model["hidden"]),
                   float(model["dropout"]), classes)
    raise NotImplementedError(
        f"load_model rebuilds mlp and cnn models; this checkpoint holds a {model['name']}. Its tensors "
        "are the load_checkpoint(path)['model.<name>'] entries.")


def load_model(path: str) -> nn.Module:
    """The trained model of a ``fusetrain train`` checkpoint as a float32
    ``torch.nn.Module`` in eval mode, giving the trainer's predictions for
    inputs normalised as the trainer's (see ``preprocess``). The model's
    ``input_mean`` and ``input_std`` attributes hold that normalisation."""
    ckpt = load_checkpoint(path)
    config = checkpoint_config(ckpt)
    model = build_model(config)
    state = {k[len("model."):]: v for k, v in ckpt.items() if k.startswith("model.")}
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    if missing or extra:
        raise ValueError(f"{path}: the checkpoint's model tensors do not match the rebuilt "
                         f"{config['model']['name']}: missing {missing}, unexpected {extra}")
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})
    model.input_mean = float(ckpt["data.mean"])
    model.input_std = float(ckpt["data.std"])
    return model.eval()


def preprocess(images: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """uint8 images [N, H, W] or [N, C, H, W] (0..255) to the trainer's
    normalised float32 input: (x / 255 - mean) / std."""
    x = images.to(torch.float32)
    if x.dim() == 3:
        x = x.unsqueeze(1)
    return (x / 255.0 - model.input_mean) / model.input_std


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fusetrain.load_checkpoint",
                                 description="Show what a fusetrain train checkpoint holds and rebuild its model.")
    ap.add_argument("path")
    args = ap.parse_args(argv)
    try:
        ckpt = load_checkpoint(args.path)
    except (OSError, RuntimeError, ValueError) as e:
        print(f"load_checkpoint: {e}", file=sys.stderr)
        return 1
    config = checkpoint_config(ckpt)
    groups: Dict[str, List[int]] = {}
    for k, v in ckpt.items():
        g = groups.setdefault(k.split(".")[0], [0, 0])
        g[0] += 1
        g[1] += v.numel() * v.element_size()
    print(f"{args.path}: step {int(ckpt['trainer.step'])} ({int(ckpt['trainer.epoch'])} epochs + "
          f"{int(ckpt['trainer.step_in_epoch'])} of {int(ckpt['trainer.steps_per_epoch'])} steps), "
          f"{config['model']['name']} on {config['data']['name']}, {config['precision']['policy']}")
    for name, (count, nbytes) in groups.items():
        print(f"  {name + '.*':<10} {count:4d} tensors  {nbytes / 1024:10.1f} KiB")
    try:
        model = load_model(args.path)
        n = sum(p.numel() for p in model.parameters())
        print(f"load_model: {type(model).__name__} with {n} parameters")
    except (NotImplementedError, ValueError) as e:
        print(f"load_model: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
