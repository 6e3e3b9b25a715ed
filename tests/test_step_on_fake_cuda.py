"""No host-to-device copy and no device read in a training step of either task (ARCHITECTURE.md, "Many ranks"), counted
on a fake CUDA device: under torch's ``FakeTensorMode`` tensors have devices and shapes but no values, so a CPU machine
runs the step as a GPU would dispatch it and :class:`step_waits.DeviceTraffic` sees every copy and read it makes. On a
GPU each blocking copy from pageable memory waits for the stream: the host could not queue the next step ahead.

The models and tasks are built as a run builds them (real, on the CPU) and then handed to the fake mode as
``.to(device)`` would: parameters and buffers on the fake device, the task's own tensors on the host where the run keeps
them. The mode admits no real tensor (``allow_non_fake_inputs=False``): a tensor a step made on the host and used on the
device would fail here too. Backward needs a real CUDA context (the autograd engine asks the driver for the device), so
a step is checked through its forward and loss; its backward and optimizer step are the GPU test's
(``test_step_waits.py``). Every op runs its reference formula (``kernels=reference``): ``auto`` picks Triton kernels on
CUDA, which need a driver to launch even under a fake mode, and are tested equal to the reference elsewhere.
"""
from dataclasses import fields

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from helpers import model_config
from step_waits import DeviceTraffic
from moh_vision.diffusion import GaussianDiffusion, create_diffusion, guided_model_fn
from moh_vision.diffusion.gaussian_diffusion import SCHEDULES
from moh_vision.ops.dispatch import REFERENCE, Kernels
from moh_vision.tasks.classification import ClassificationTask
from moh_vision.tasks.diffusion import DiffusionTask

pytestmark = pytest.mark.usefixtures("one_thread")

CUDA = torch.device("cuda", 0)
EVERY_OP_REFERENCE = {entry.name: REFERENCE for entry in fields(Kernels)}
MOH = {"name": "moh", "aux_loss_weight": 0.01}  # the activation-ratio policy's MoH in every block


class Data:
    """What the tasks' ``build_model`` read of a data module (no images are loaded: the batches are made up)."""

    def __init__(self, img_size: int):
        self.num_classes, self.in_chans, self.img_size = 10, 1, img_size
        self.mixup, self.label_smoothing = None, 0.0


def to_fake_device(mode: FakeTensorMode, model: nn.Module, device: torch.device) -> nn.Module:
    """``model.to(device)`` under ``mode`` (which ``Module.to`` cannot do for fake tensors): every parameter and buffer
    replaced by a fake tensor of its shape and dtype on ``device``."""
    with mode:
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is not None:
                    module._parameters[name] = nn.Parameter(mode.from_tensor(param).to(device),
                                                            requires_grad=param.requires_grad)
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = mode.from_tensor(buffer).to(device)
    return model


def fake_host_state(mode: FakeTensorMode, state) -> None:
    """The tensors among ``state``'s attributes replaced by fake ones on the host, where the run keeps them."""
    for name, value in list(vars(state).items()):
        if isinstance(value, torch.Tensor):
            setattr(state, name, mode.from_tensor(value))


def fake_step(task, model: nn.Module, batch, steps: int = 2):
    """Run ``task.training_step`` ``steps`` times on ``batch`` (fake CPU tensors, moved by the step as a loader's batch
    is); each step's :class:`DeviceTraffic` and the last step's output."""
    traffic, out = [], None
    for _ in range(steps):
        with DeviceTraffic(allowed=batch) as counted:
            out = task.training_step(model, batch, CUDA)
        traffic.append(counted)
    assert out["loss"].device == CUDA and out["loss"].shape == ()
    return traffic, out


def test_the_counter_sees_copies_and_reads():
    with FakeTensorMode(allow_non_fake_inputs=False):
        host, device = torch.ones(3), torch.ones(3, device="cuda")
        with DeviceTraffic(allowed=[host]) as allowed:
            host.to("cuda")
        with DeviceTraffic() as traffic:
            host.to("cuda")                       # copies
            device.copy_(host)
            torch.tensor([1.0, 2.0], device="cuda")
            device[torch.tensor([0, 1])]
            device.sum().item()                   # reads
            bool(device.sum())
            device.tolist()
            device.cpu()
            with pytest.raises(Exception):
                device.nonzero()
            device * 2                            # neither
            torch.where(device > 0, 1.0, float("nan"))
            torch.full((3,), 4, device="cuda")
            device * torch.tensor(2.0)
            device[torch.arange(2, device="cuda")]
    assert allowed.copies == [] and allowed.reads == []
    assert [entry.split(" at ")[0] for entry in traffic.copies] == [
        "aten._to_copy.default cpu->cuda:0", "aten.copy_.default cpu->cuda:0", "aten._to_copy.default cpu->cuda:0",
        "aten.index.Tensor cpu->cuda:0"]
    assert [entry.split(" ")[0] for entry in traffic.reads] == [
        "aten._local_scalar_dense.default"] * 5 + ["aten._to_copy.default", "aten.nonzero.default"]


def test_a_diffusion_step_makes_no_copy_and_no_read():
    """MoH-DiT (dit_tiny_2 with MoH, two blocks) on the digits' 16x16 diffusion: the schedules, the timesteps, the
    noise, the loss terms and the ``t`` the model sees stay on the device. The first step places the schedules there
    (two copies: the table of schedules and the timestep map); every later step copies nothing and reads nothing."""
    task = DiffusionTask(model_config("dit_tiny_2", kwargs={"depth": 2}), MOH, kernels=EVERY_OP_REFERENCE)
    model = task.build_model(Data(img_size=16)).train()
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        model = to_fake_device(mode, model, CUDA)
        fake_host_state(mode, task.diffusion)
        batch = (torch.randn(4, 1, 16, 16), torch.randint(0, 10, (4,)))
        (first, later), out = fake_step(task, model, batch)
    assert later.copies == [] and later.reads == []
    assert first.reads == [] and len(first.copies) == 2, first.copies
    assert all("schedules_on" in entry for entry in first.copies), first.copies
    assert out["routing"] and {"log/mse", "log/vb"} <= set(out), "the MoH layers routed; the hybrid loss's terms"


def test_a_respaced_sampling_step_makes_no_copy_and_no_read():
    """A respaced DDPM step as the sampling loops take it (the timestep map translates ``t`` on the device)."""
    task = DiffusionTask(model_config("dit_tiny_2", kwargs={"depth": 2}), MOH, kernels=EVERY_OP_REFERENCE)
    model = task.build_model(Data(img_size=16)).eval()
    diffusion = create_diffusion("10")
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        model = to_fake_device(mode, model, CUDA)
        fake_host_state(mode, diffusion)
        guided = guided_model_fn(model, 4.0, null_class=10)
        x, y = torch.randn(2, 1, 16, 16, device="cuda"), torch.randint(0, 10, (2,), device="cuda")
        traffic = []
        with torch.no_grad():
            for sampler in ("ddpm", "ddim", "ddpm"):
                with DeviceTraffic() as counted:
                    steps = diffusion.sample_loop_progressive(guided, x.shape, sampler, noise=x, model_kwargs={"y": y},
                                                              eta=0.5)
                    next(steps)
                traffic.append(counted)
    assert all("schedules_on" in entry for entry in traffic[0].copies) and traffic[0].reads == []
    assert [(t.copies, t.reads) for t in traffic[1:]] == [([], [])] * 2


def test_a_classification_step_makes_no_copy_and_no_read():
    """The default run's MoH TransNeXt-nano, at 32x32: no step copies or reads, the first one included."""
    task = ClassificationTask(model_config("transnext_nano"), MOH, kernels=EVERY_OP_REFERENCE)
    model = task.build_model(Data(img_size=32)).train()
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        model = to_fake_device(mode, model, CUDA)
        batch = (torch.randn(4, 1, 32, 32), torch.randint(0, 10, (4,)))
        traffic, out = fake_step(task, model, batch)
    assert [(t.copies, t.reads) for t in traffic] == [([], [])] * 2
    assert out["routing"], "the MoH layers routed"


class ReadsTheHostSchedules(GaussianDiffusion):
    """The process as it read its schedules before they were placed on the device: the host attributes at every use."""

    def schedules_on(self, device):
        return {name: getattr(self, name).to(device) for name in (*SCHEDULES, "timestep_map")}


class TanhModel(nn.Module):
    """A model with DiT's signature whose output depends on x, t and y (learned-sigma layout when ``learn_sigma``)."""

    def __init__(self, learn_sigma: bool, channels: int = 3):
        super().__init__()
        out = 2 * channels if learn_sigma else channels
        self.conv, self.t_embed = nn.Conv2d(channels, out, 3, padding=1), nn.Embedding(1000, out)
        self.y_embed = nn.Embedding(4, out)

    def forward(self, x, t, y):
        return torch.tanh(self.conv(x) + (self.t_embed(t) + self.y_embed(y))[:, :, None, None])


@pytest.mark.parametrize("variance", [dict(learn_sigma=True), dict(learn_sigma=False), dict(learn_sigma=False,
                                      sigma_small=True), dict(learn_sigma=True, use_kl=True)],
                         ids=["learned", "fixed_large", "fixed_small", "kl"])
def test_the_placed_schedules_give_the_same_bits_on_the_cpu(variance):
    """The schedules read from their device copy give the bits the host attributes give: training losses in float32 and
    float64 on the full and a respaced process, and every step of respaced DDPM and DDIM sampling."""
    torch.manual_seed(0)
    for respacing in ("", "ddim10", "25"):
        placed = create_diffusion(respacing, **variance)
        host = ReadsTheHostSchedules(placed.betas, placed.mean_type, placed.var_type, placed.loss_type,
                                     placed.timestep_map)
        for dtype in (torch.float32, torch.float64):
            model = TanhModel(placed.learn_sigma).to(dtype)
            x0, y = torch.randn(6, 3, 4, 4, dtype=dtype), torch.randint(0, 4, (6,))
            t, noise = torch.randint(0, placed.num_timesteps, (6,)), torch.randn_like(x0)
            t[0] = 0  # the decoder term
            ours, theirs = (d.training_losses(model, x0, t, {"y": y}, noise=noise) for d in (placed, host))
            assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
            if not respacing:
                continue
            for sampler in ("ddpm", "ddim"):
                runs = [list(d.sample_loop_progressive(model, x0.shape, sampler, noise=x0, model_kwargs={"y": y},
                                                       eta=0.5, clip_denoised=True,
                                                       generator=torch.Generator().manual_seed(1)))
                        for d in (placed, host)]
                assert all(torch.equal(a["sample"], b["sample"]) and torch.equal(a["pred_xstart"], b["pred_xstart"])
                           for a, b in zip(*runs))
