"""Checkpoints of ``fusetrain train`` in Python.

A trainer checkpoint is a ``dict`` of tensors that ``torch.load`` reads
(``weights_only=True`` included): ``model.<name>`` holds the parameters and
buffers, ``optim.*`` the optimizer state, ``scaler.*`` the loss scaler,
``trainer.*`` the step and data position, ``rng.*`` the random state,
``data.mean``/``data.std`` the input normalisation and ``config.yaml`` the
resolved run configuration (text stored as a uint8 tensor).

``load_model`` rebuilds the trained network as an ordinary ``torch.nn.Module``
(``mlp``, ``cnn``, ``resnet`` and ``gpt``, with the C++ models' parameter
names and shapes) that gives the trainer's predictions::

    from fusetrain.load_checkpoint import load_model, preprocess
    model = load_model("runs/fashion_mnist-20250101-120000/checkpoints/step_00003744.pt")
    logits = model(preprocess(images_uint8, model))   # images [N, 28, 28] or [N, 1, 28, 28]

From a shell, ``python -m fusetrain.load_checkpoint PATH`` prints what a
checkpoint holds.
"""

from __future__ import annotations

import argparse
import sys
from typing import Dict, List, Optional, Union

import torch
from torch import nn

__all__ = ["load_checkpoint", "checkpoint_config", "build_model", "load_model", "preprocess", "main"]


def load_checkpoint(path: str) -> Dict[str, torch.Tensor]:
    """The tensors of the checkpoint file at ``path``, on the CPU (read with
    ``weights_only=True``). A file that is not a ``fusetrain train``
    checkpoint (no ``config.yaml`` entry) is a ``ValueError``."""
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
    """The run configuration stored in the checkpoint ``ckpt`` (what
    :func:`load_checkpoint` returns): ``{section: {key: value}}``."""
    return _parse_config(_text(ckpt["config.yaml"]))


def _dense_stack(n: int, hidden: List[int], dropout: float):
    """Flatten, [linear, ReLU] per hidden size, optional dropout (the C++
    models' layout and names); returns the stack and its output width."""
    layers: List[nn.Module] = [nn.Flatten()]
    for size in hidden:
        layers += [nn.Linear(n, size), nn.ReLU()]
        n = size
    if dropout > 0:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers), n


class Mlp(nn.Module):
    """The trainer's ``mlp``: flatten, [linear, ReLU] per hidden size, optional dropout, head."""

    def __init__(self, input_shape: List[int], hidden: List[int], dropout: float, classes: int):
        super().__init__()
        n = 1
        for s in input_shape:
            n *= s
        self.layers, n = _dense_stack(n, hidden, dropout)
        self.head = nn.Linear(n, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


class Cnn(nn.Module):
    """The trainer's ``cnn``: per channel count a block of ``convs_per_block``
    x [3x3 conv (no bias), batch norm, ReLU] and 2x2 max pooling; then
    flatten, [linear, ReLU] per hidden size, optional dropout, and the head.
    ``convs_per_block`` is one count for every block or a list, one a block."""

    def __init__(self, input_shape: List[int], channels: List[int], hidden: List[int], dropout: float,
                 classes: int, convs_per_block: Union[int, List[int]] = 1):
        super().__init__()
        c, h, w = input_shape
        convs = [convs_per_block] if isinstance(convs_per_block, int) else list(convs_per_block)
        if len(convs) == 1:
            convs *= len(channels)
        if len(convs) != len(channels):
            raise ValueError(f"convs_per_block has {len(convs)} counts for {len(channels)} blocks: "
                             "give one count, or one per block")
        features: List[nn.Module] = []
        for ch, n_convs in zip(channels, convs):
            for k in range(n_convs):
                features += [nn.Conv2d(c if k == 0 else ch, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch),
                             nn.ReLU()]
            features.append(nn.MaxPool2d(2))
            c, h, w = ch, h // 2, w // 2
        self.features = nn.Sequential(*features)
        self.classifier, n = _dense_stack(c * h * w, hidden, dropout)
        self.head = nn.Linear(n, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.classifier(self.features(x)))


def _conv(cin: int, cout: int, k: int, stride: int) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False)


def _shortcut(cin: int, cout: int, stride: int):
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(_conv(cin, cout, 1, stride), nn.BatchNorm2d(cout))


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int):
        super().__init__()
        self.conv1, self.bn1 = _conv(cin, planes, 3, stride), nn.BatchNorm2d(planes)
        self.conv2, self.bn2 = _conv(planes, planes, 3, 1), nn.BatchNorm2d(planes)
        self.downsample = _shortcut(cin, planes, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (self.downsample(x) if self.downsample is not None else x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int):
        super().__init__()
        self.conv1, self.bn1 = _conv(cin, planes, 1, 1), nn.BatchNorm2d(planes)
        self.conv2, self.bn2 = _conv(planes, planes, 3, stride), nn.BatchNorm2d(planes)
        self.conv3, self.bn3 = _conv(planes, planes * 4, 1, 1), nn.BatchNorm2d(planes * 4)
        self.downsample = _shortcut(cin, planes * 4, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return torch.relu(out + (self.downsample(x) if self.downsample is not None else x))


class ResNet(nn.Module):
    """The trainer's ``resnet``: the CIFAR variant (3x3 stem, no max pooling),
    four stages of BasicBlocks (depth 18) or Bottlenecks (depth 50), global
    average pooling, the head."""

    def __init__(self, input_shape: List[int], depth: int, width: int, classes: int):
        super().__init__()
        block = BasicBlock if depth == 18 else Bottleneck
        blocks = [2, 2, 2, 2] if depth == 18 else [3, 4, 6, 3]
        self.conv1, self.bn1 = _conv(input_shape[0], width, 3, 1), nn.BatchNorm2d(width)
        cin = width
        for stage, count in enumerate(blocks):
            planes = width << stage
            layer = []
            for b in range(count):
                layer.append(block(cin, planes, 2 if stage > 0 and b == 0 else 1))
                cin = planes * block.expansion
            setattr(self, f"layer{stage + 1}", nn.Sequential(*layer))
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        for stage in range(1, 5):
            out = getattr(self, f"layer{stage}")(out)
        return self.head(out.mean((2, 3)))


class GptBlock(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc, self.fc_proj = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads, self.dropout = heads, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        h = x + torch.nn.functional.dropout(self.proj(y.transpose(1, 2).reshape(b, t, d)), p, self.training)
        mlp = self.fc_proj(torch.nn.functional.gelu(self.fc(self.ln2(h))))
        return h + torch.nn.functional.dropout(mlp, p, self.training)


class Gpt(nn.Module):
    """The trainer's ``gpt``: byte-level (256 tokens), learned positions,
    pre-LN blocks with causal attention and a 4x GELU MLP, final LayerNorm,
    the head; logits ``[N, T, 256]`` for token ids ``[N, T]``."""

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, seq_len: int, dropout: float):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Parameter(torch.zeros(seq_len, d_model))
        self.blocks = nn.ModuleList(GptBlock(d_model, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.pos_emb.shape[0]:
            raise ValueError(f"gpt: a sequence of {t} tokens is longer than model.seq_len={self.pos_emb.shape[0]}")
        x = self.tok_emb(idx) + self.pos_emb[:t]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _input_shape(config) -> List[int]:
    data = config["data"]
    if data["name"] == "fashion_mnist":
        return [1, 28, 28]
    if data["name"] == "synthetic_images":
        return [int(data["channels"]), int(data["image_size"]), int(data["image_size"])]
    raise ValueError(f"data.name={data['name']} is token data: only a gpt reads it")


def _as_list(v) -> List[int]:
    return [int(x) for x in (v if isinstance(v, list) else [v])]


def build_model(config, input_shape: Optional[List[int]] = None,
                classes: Optional[int] = None) -> nn.Module:
    """An untrained ``mlp``, ``cnn``, ``resnet`` or ``gpt`` as the run
    configuration describes it (parameter names as the C++ models').
    ``input_shape`` (per sample) and ``classes`` (or the vocabulary) come
    from the checkpoint where the config alone does not fix them (the user's
    data files)."""
    model = config["model"]
    if model["name"] == "gpt":
        return Gpt(classes or 256, int(model["d_model"]), int(model["n_head"]), int(model["n_layer"]),
                   int(model["seq_len"]), float(model["dropout"]))
    if classes is None:
        classes = 10 if config["data"]["name"] == "fashion_mnist" else int(config["data"]["num_classes"]) or 10
    shape = input_shape or _input_shape(config)
    if model["name"] == "mlp":
        return Mlp(shape, _as_list(model["hidden"]), float(model["dropout"]), classes)
    if model["name"] == "cnn":
        return Cnn(shape, _as_list(model["channels"]), _as_list(model["hidden"]),
                   float(model["dropout"]), classes, _as_list(model.get("convs_per_block", 1)))
    if model["name"] == "resnet":
        return ResNet(shape, int(model["depth"]), int(model["width"]), classes)
    raise NotImplementedError(f"load_model does not know the model {model['name']!r}")


def load_model(path: str) -> nn.Module:
    """The trained model of the ``fusetrain train`` checkpoint at ``path`` as
    a float32 ``torch.nn.Module`` in eval mode, giving the trainer's
    predictions for inputs normalised as the trainer's (see ``preprocess``).
    The model's ``input_mean`` and ``input_std`` attributes hold that
    normalisation. A checkpoint whose model tensors do not match the rebuilt
    model is a ``ValueError``; a model this module cannot rebuild a
    ``NotImplementedError``."""
    ckpt = load_checkpoint(path)
    config = checkpoint_config(ckpt)
    shape = ckpt["data.input_shape"].tolist() if "data.input_shape" in ckpt else None
    classes = int(ckpt["data.num_classes"]) if "data.num_classes" in ckpt else None
    model = build_model(config, shape, classes)
    # A mixed_float8 run's float8 scaling state (fp8_scale, fp8_amax_history)
    # has no use in the float32 model.
    state = {k[len("model."):]: v for k, v in ckpt.items()
             if k.startswith("model.") and not k.rpartition(".")[2].startswith("fp8_")}
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
    """uint8 ``images`` [N, H, W] or [N, C, H, W] (0..255) to the trainer's
    normalised float32 input: (x / 255 - mean) / std, with the mean and std
    of ``model`` (its ``input_mean`` and ``input_std``, as
    :func:`load_model` sets them)."""
    x = images.to(torch.float32)
    if x.dim() == 3:
        x = x.unsqueeze(1)
    return (x / 255.0 - model.input_mean) / model.input_std


def main(argv=None) -> int:
    """The command line, ``python -m fusetrain.load_checkpoint PATH``:
    ``argv`` the arguments (default None: ``sys.argv[1:]``). Prints the
    checkpoint's step, model, data and policy, its tensors grouped by prefix,
    and the model :func:`load_model` rebuilds (or why it cannot); returns 0,
    or 1 when the file does not load as a checkpoint."""
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
