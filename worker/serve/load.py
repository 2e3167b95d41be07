"""Building the torch engine a worker serves: torch's threads, the device, the
kernels' instruction set, the precision, the model (or the copy loaded before
this process forked, `preload`), and a check that the KV cache fits in memory.
Each refusal is a ConfigError that names the setting to change."""

from __future__ import annotations

import logging
import os

import torch

from protocol.settings import ConfigError
from worker.engine.chat_template import choose_chat_template
from worker.engine.memory_limit import memory_limit_bytes, resident_bytes
from worker.engine.torch_engine import TorchEngine
from worker.model.cpu_isa import check_aten_capability, chosen_isa
from worker.model.gpt2 import GPT2
from worker.model.kv_cache import SlotKVCache
from worker.model.loader import LoadedModel, load_model
from worker.model.precision import Precision
from worker.serve.config import WorkerConfig

logger = logging.getLogger(__name__)


def load_engine(config: WorkerConfig) -> TorchEngine:
    """The worker's engine for any MODEL_ID other than 'fake'. Raises ConfigError
    (ModelLoadError) when the model or device cannot be used."""
    torch.set_num_threads(config.torch_threads or len(os.sched_getaffinity(0)))
    device = resolve_device(config.device)
    if device.type == "cpu":
        # A KERNEL_ISA or ATEN_CPU_CAPABILITY this CPU cannot run is refused now,
        # not after loading.
        chosen_isa()
        check_aten_capability()
    precision = Precision.for_device(device, config.dtype, config.weights, config.bfloat16_products)
    if config.prefix_cache and not config.prefill_chunk_tokens:
        logger.warning(
            "PREFIX_CACHE is on but PREFILL_CHUNK_TOKENS=0: the prefix cache takes its rows "
            "between chunks of prefill, so it is off; set PREFILL_CHUNK_TOKENS > 0 to use it"
        )
    preloaded = _take_preloaded(config, device, precision)
    if preloaded is None:
        # Not before: a worker forked with a model that fell back said it would
        # load the one that could not be loaded.
        logger.info(
            "worker loading %s%s",
            config.model_to_load,
            "" if config.model_id else " (MODEL_ID unset: synthetic if it cannot be loaded)",
        )
    loaded, gpt2 = preloaded or (_load(config, device, precision), None)
    _check_kv_cache_fits(config, loaded, precision, device)
    chat_template = choose_chat_template(
        config.chat_template, loaded.hf_tokenizer, loaded.special_tokens
    )
    return TorchEngine(
        loaded,
        config.max_batch_size,
        chat_template=chat_template,
        precision=precision,
        gpt2=gpt2,
        prefill_chunk_tokens=config.prefill_chunk_tokens,
        cuda_graphs=config.cuda_graphs,
        prefix_cache=config.prefix_cache,
    )


def _check_kv_cache_fits(
    config: WorkerConfig, loaded: LoadedModel, precision: Precision, device: torch.device
) -> None:
    """Refuse a MAX_BATCH_SIZE whose KV cache (on CPU, in each of the workers
    sharing the host, beside what this one holds already: the model, torch) is
    more than the memory this process may use: allocating it would fail with a
    traceback, or worse, be overcommitted and bring the OOM killer at the first
    touch, with nothing said, again at each restart."""
    model = loaded.model.config
    num_slots = config.max_batch_size
    num_bytes = SlotKVCache.nbytes_for(
        model.n_layer, num_slots, model.n_positions, model.n_embd, precision.storage
    )
    shape = (
        f"{model.n_layer} layers x K,V x {num_slots} slots x {model.n_positions} positions "
        f"x {model.n_embd} x {precision.storage.itemsize} bytes"
    )
    if device.type == "cuda":
        memory, source = torch.cuda.mem_get_info(device)[1], "this GPU's memory"
        workers, held = 1, 0
    else:
        memory, source = memory_limit_bytes()
        workers, held = config.num_workers, resident_bytes()
    # Steps need working memory besides (activations, the math library's
    # scratch): 0.4 GiB for synthetic, beside 0.69 GiB held at this point.
    working = held // 2
    if held + working + num_bytes * workers <= memory:
        return
    needs, lower = f"a KV cache of {_gib(num_bytes)} ({shape})", "MAX_BATCH_SIZE"
    if workers > 1:
        needs += f" in each of NUM_WORKERS={workers}, {_gib(num_bytes * workers)} in all"
        lower += " or NUM_WORKERS"
    needs += (
        f", which with the {_gib(held)} this worker holds already (the model, torch) "
        f"and {_gib(working)} for its steps' working memory is"
        if held
        else ","
    )
    raise ConfigError(
        f"MAX_BATCH_SIZE={num_slots} needs {needs} more than the {_gib(memory)} this "
        f"process may use ({source}): lower {lower}"
    )


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:,.2f} GiB"


def preload(config: WorkerConfig) -> None:
    """Load the model a worker of ``config`` will serve, in a process that workers
    then fork from (`worker.launch.preload`): each starts with it loaded. CPU models only,
    and on one thread: a process that has initialised CUDA, or started an OpenMP
    thread pool, cannot fork a child that uses them."""
    global _preloaded
    has_gpu_build = torch.version.cuda is not None or torch.version.hip is not None
    is_cpu = config.device == "cpu" or (not config.device and not has_gpu_build)
    if not is_cpu:
        return
    torch.set_num_threads(1)
    device = torch.device("cpu")
    precision = Precision.for_device(device, config.dtype, config.weights, config.bfloat16_products)
    loaded = _load(config, device, precision)
    # The engine's own copies of the weights too (transposed, packed, narrowed):
    # built here, they are shared by every worker rather than made by each.
    _preloaded = _preload_key(config, device, precision), (loaded, GPT2(loaded.model, precision))


# What `preload` loaded before this process forked, and how it was loaded.
_preloaded: tuple[tuple[object, ...], tuple[LoadedModel, GPT2]] | None = None


def _preload_key(
    config: WorkerConfig, device: torch.device, precision: Precision
) -> tuple[object, ...]:
    return config.model_to_load, not config.model_id, str(device), precision


def _take_preloaded(
    config: WorkerConfig, device: torch.device, precision: Precision
) -> tuple[LoadedModel, GPT2] | None:
    if _preloaded is None or _preloaded[0] != _preload_key(config, device, precision):
        return None
    logger.info("%s was loaded before this worker forked", _preloaded[1][0].name)
    return _preloaded[1]


def _load(config: WorkerConfig, device: torch.device, precision: Precision) -> LoadedModel:
    return load_model(
        config.model_to_load, device, precision.compute, may_fall_back=not config.model_id
    )


def resolve_device(name: str) -> torch.device:
    if not name:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"DEVICE={name} but torch sees no CUDA device: set DEVICE=cpu")
    return torch.device(name)
