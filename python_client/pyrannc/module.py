"""RaNNCModule: a torch.nn.Module whose forward, backward and optimizer step run in ranncd.

Lifecycle: the wrapped model stays local until the first forward, which traces it
(torch.jit.trace on those inputs, in the current train/eval/dropout mode; or reuses the trace
kept in load_deployment's file when the model is the same, see save_deployment) and creates the
job.
From then on the daemon owns parameters, buffers, gradients and optimizer state; the local model
is a mirror refreshed on demand (named_parameters(), state_dict(), ...) after anything that may
have changed it (a step, a training-mode forward, a load). A change of mode traces the model
again in the new mode on the next forward, if the daemon has no graph for it yet.

Tracing lives in pyrannc._tracing, the client's record of its job in pyrannc._jobs; this module
drives the job through the daemon's RPCs.

Threading: one RaNNCModule is meant to be driven from one thread at a time, like a torch module
in a training loop.
"""

import collections
import gc
import json
import logging
import os
import time
import warnings
import weakref
from typing import Dict, List, Optional, Tuple

import grpc
import torch

from pyrannc import (_checkpoints, _codec, _config, _daemon, _deployment, _jobs, _numerics, _optim,
                     _outputs, _runtime, _save_job, _saved_trace, _shm, _tensors, _tracing)
from pyrannc.errors import RanncError
from pyrannc.proto.rannc.v1 import deployment_pb2
from pyrannc.proto.rannc.v1 import training_pb2 as pb

logger = logging.getLogger("pyrannc")


class _RemoteForward(torch.autograd.Function):
    """Runs Forward in the daemon; its backward sends the output grads to Backward.

    `dummy` is a leaf that requires grad, so the outputs join the caller's autograd graph even
    though no local tensor flows into the daemon's computation.
    """

    @staticmethod
    def forward(ctx, dummy, module, inputs, differentiable):
        ctx.set_materialize_grads(False)
        outputs, forward_id = module._forward_rpc(inputs, requires_grad=True)
        ctx.module = module
        ctx.forward_id = forward_id
        frozen = [o for o, d in zip(outputs, differentiable)
                  if not (d and (o.is_floating_point() or o.is_complex()))]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.module._backward_rpc(ctx.forward_id, grads)
        return None, None, None, None


def _without_state_dict_hooks(model: torch.nn.Module, *args, **kwargs):
    """model.state_dict() with no module's state_dict hooks run (RaNNC's no_hook=True)."""
    saved = [(m, m._state_dict_hooks) for m in model.modules()]
    try:
        for m, _ in saved:
            m._state_dict_hooks = collections.OrderedDict()
        return model.state_dict(*args, **kwargs)
    finally:
        for m, hooks in saved:
            m._state_dict_hooks = hooks


class RaNNCModule(torch.nn.Module):
    """Trains `model` in ranncd; a drop-in for RaNNC's pyrannc.RaNNCModule.

    The first call traces `model` on its inputs and submits it; the daemon plans it (pipeline
    stages, replicas, micro-batches) unless `load_deployment` names a deployment file written by
    save_deployment, which is checked here and sent instead (ValueError now if it is not a
    deployment; the daemon refuses one made for another model or that no longer fits).
    enable_zero=True shards gradients and optimizer state over each stage's replicas (ZeRO
    stage 2; results equal the unsharded job's). enable_apex_amp=True runs every forward under
    torch.autocast to the config key amp_dtype (bf16, the default and what CPU devices support,
    or fp16 on CUDA), or with the config key amp_level=O2 the whole forward in amp_dtype
    (parameters and floating inputs cast on entry, as FSDP2's bf16 parameters and Apex's O2 do;
    outputs in amp_dtype), with the parameters, gradients and optimizer state kept fp32 (the
    masters, which amp_master_param(s)=True reads). allreduce_amp_master_params=True makes the
    replicas all-reduce the fp32 masters' gradients; with False, RaNNC's default, at amp_level O2
    they all-reduce them in amp_dtype (half the bytes, at its precision: as Apex's fp16 model
    gradients), at O1 in fp32 anyway. offload_params=True keeps the parameters,
    their gradients between steps and the optimizer state in host memory, each device holding
    its stage's parameters only during a step (with enable_zero, the host keeps each replica's
    shard); the local model's large tensors are then freed once the daemon has them, until a
    read of the local model fetches them back (the client key keep_local_model keeps them).
    Results equal the job's without these switches.
    """

    def __init__(self, model: torch.nn.Module, optimizer=None, gather_inputs=True,
                 load_deployment=None, enable_apex_amp=False, allreduce_amp_master_params=False,
                 enable_zero=False, check_unused_values=True, offload_params=False):
        if allreduce_amp_master_params and not enable_apex_amp:
            raise ValueError("allreduce_amp_master_params=True needs enable_apex_amp=True")
        _runtime.check_ranks()
        # Read now, so a bad file fails here rather than at the first forward.
        deployment_bytes = b""
        deployment_path = None
        loaded_trace = None
        if load_deployment is not None:
            deployment_path = os.fspath(load_deployment)
            deployment_bytes, loaded_trace = _deployment.split_saved_trace(
                _deployment.read_deployment_bytes(deployment_path))
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"RaNNCModule wraps a torch.nn.Module, got {type(model).__name__}")
        if isinstance(model, torch.jit.ScriptModule):
            raise TypeError("RaNNCModule traces the model itself; pass the Python module, not a "
                            "ScriptModule")
        if optimizer is not None:
            _optim.optimizer_type(optimizer)
        super().__init__()
        self.model = model
        self.training = model.training
        self._optimizer = optimizer
        self._gather_inputs = bool(gather_inputs)
        self._check_unused_values = bool(check_unused_values)
        self._enable_zero = bool(enable_zero)
        self._offload_params = bool(offload_params)
        self._amp = bool(enable_apex_amp)
        self._allreduce_amp_master_params = bool(allreduce_amp_master_params)
        # The config keys this module's job was created with (amp_level, amp_dtype, ...).
        self._job_config: Optional[Dict[str, str]] = None
        self._job: Optional[_jobs.Job] = None
        self._deployment_bytes = deployment_bytes
        self._deployment_path = deployment_path
        # The trace load_deployment's file holds, which a job of this module may reuse.
        self._loaded_trace: Optional[deployment_pb2.SavedTrace] = loaded_trace
        # The plan of the latest job; kept past clear()/undeploy so it can still be saved.
        self._deployment = None
        # The latest job's trace (graph only), saved with its plan; None when unfingerprintable.
        self._saved_trace: Optional[deployment_pb2.SavedTrace] = None
        self._no_trace_reason = ""  # why _saved_trace is None after a job was created
        self._save_forward = False  # RANNC_SAVE_JOB: the next training forward is saved too
        self._plan_summary: Optional[str] = None
        self._job_token: Optional[str] = None
        self._dropout: Optional[bool] = None  # enable_dropout(); None: follows training
        self._state_dirty = False
        # With offload_params: the local model's tensors sent to the daemon, their memory freed
        # (_release_local_model) until a read of the local model allocates and fills it again.
        self._released: Optional[_tensors.Released] = None
        self._resumed_step: Optional[int] = None  # of the job's checkpoint (config key resume)
        # A leaf that makes forward's outputs require grad; never receives a gradient.
        self._grad_anchor = torch.zeros((), requires_grad=True)
        if optimizer is not None:
            _optim.patch(optimizer, self)
        _runtime.register(self)

    # ------------------------------------------------------------------------------------------
    # Attribute access: like RaNNC, unknown attributes come from the wrapped model.

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_modules", {}).get("model")
            if model is None or name.startswith("__"):
                raise
            return getattr(model, name)

    # ------------------------------------------------------------------------------------------
    # Forward / backward.

    def forward(self, *args, **kwargs):
        if kwargs:
            raise ValueError("RaNNCModule takes the model's inputs as positional tensors; "
                             f"got keyword arguments {sorted(kwargs)}")
        inputs = self._check_inputs(args)
        mode = self._current_mode()
        if self._job is None:
            self._create_job(inputs, mode)
        elif _jobs.mode_key(self._job.mode) != _jobs.mode_key(mode):
            self._switch_mode(inputs, mode)
        spec = self._job.specs[_jobs.mode_key(self._job.mode)]
        if torch.is_grad_enabled():
            differentiable = [leaf.requires_grad for leaf in _outputs.leaves(spec)]
            flat = _RemoteForward.apply(self._grad_anchor, self, inputs, differentiable)
        else:
            flat, _ = self._forward_rpc(inputs, requires_grad=False)
        return _outputs.unflatten(spec, list(flat))

    def _check_inputs(self, args) -> Tuple[torch.Tensor, ...]:
        if not args:
            raise ValueError("RaNNCModule needs at least one input tensor")
        names = _tracing.input_names(self.model, len(args))
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                raise TypeError(f"RaNNCModule inputs must be tensors; input '{names[i]}' (#{i}) "
                                f"is a {type(a).__name__}")
        return tuple(a.detach() for a in args)

    def _current_mode(self) -> pb.Mode:
        training = self.model.training
        dropout = training if self._dropout is None else self._dropout
        return pb.Mode(training=training, dropout=dropout)

    def _connection(self) -> _daemon.Connection:
        """The connection to the daemon that leads this module's job."""
        return _daemon.connection(self._job.address if self._job is not None else None)

    def _names_by_id(self) -> Dict[int, str]:
        return {id(p): n for n, p in self.model.named_parameters()}

    def _create_job(self, inputs, mode: pb.Mode) -> None:
        conn = _daemon.connection()
        _jobs.delete_orphaned_jobs(conn)
        inputs, plan_batch = _tracing.trace_inputs(inputs)
        rank, world = _runtime.get_rank(), _runtime.get_world_size()
        # Read once: the daemon's lease and this process's renewals agree.
        lease = _jobs.lease_seconds()
        started = time.perf_counter()
        fingerprint, why_not = _saved_trace.fingerprint(self.model, inputs, mode.training,
                                                        mode.dropout)
        logger.debug("pyrannc: fingerprinted the model in %.3f s", time.perf_counter() - started)
        self._no_trace_reason = why_not
        reused = self._reuse_trace(conn, rank, fingerprint, why_not)
        if reused is not None:
            model_bytes, spec, apart = reused
        else:
            # On the daemon's host, large tensors skip the archive and travel through shared
            # memory (the archive would copy them into a zip, the model stream and the daemon's
            # string). Ranks other than 0 send no model: their trace only gives the outputs'
            # structure.
            apart_bytes = 0 if rank > 0 else _shm.MIN_BYTES if conn.shm is not None else None
            if rank == 0 and apart_bytes is not None and not _shm.has_room(
                    conn.shm, _tensors.distinct_bytes(self.model, apart_bytes)):
                logger.info("pyrannc: %s has too little free space for the model's tensors; they "
                            "go inside the TorchScript archive instead", conn.shm.directory)
                apart_bytes = None
            model_bytes, spec, apart, graph_bytes = _tracing.trace(
                self.model, inputs, mode, apart_bytes, graph_only=fingerprint is not None)
            self._saved_trace = None if fingerprint is None else deployment_pb2.SavedTrace(
                archive=graph_bytes, outputs=_saved_trace.outputs_to_json(spec),
                fingerprint=json.dumps(fingerprint))
        names_by_id = self._names_by_id()
        optimizer_spec = _optim.optimizer_spec(self._optimizer, names_by_id)
        if rank > 0:
            # Rank 0 creates the job; the others join it by name.
            join = pb.JoinJobRequest(name=_jobs.job_name(self.model), client_rank=rank,
                                     client_world=world, timeout_ms=_jobs.client_timeout_ms())
            resp = conn.call("JoinJob", join)
            address = None
            if resp.leader:
                # Rank 0 created the job on another daemon of the cluster: join it there.
                address = resp.leader
                conn = _daemon.connection(address)
                resp = conn.call("JoinJob", join)
            self._adopt_job(conn, resp, mode, spec, lease, owner=False, address=address)
            if _runtime.sync_params_on_init_flag:
                # Every rank's local model starts as the job's (rank 0's), as RaNNC's broadcast
                # from rank 0 makes it.
                self._sync_from_daemon(force=True)
            return
        self._job_config = _jobs.job_config(plan_batch)
        options = pb.JobOptions(gather_inputs=self._gather_inputs,
                                check_unused_values=self._check_unused_values,
                                enable_zero=self._enable_zero,
                                offload_params=self._offload_params,
                                enable_apex_amp=self._amp,
                                allreduce_amp_master_params=self._allreduce_amp_master_params,
                                config=self._job_config,
                                load_deployment=self._deployment_bytes,
                                client_world=world, client_timeout_ms=_jobs.client_timeout_ms(),
                                lease_ms=int(lease * 1000),
                                numerics=_numerics.client_numerics())
        with _shm.session(conn.shm) as wire, _shm.bulk_session(conn.shm) as bulk:
            started = time.perf_counter()
            job_spec = pb.JobSpec(
                name=_jobs.job_name(self.model),
                mode=mode, optimizer=optimizer_spec, options=options,
                example_inputs=[wire.encode(x) for x in inputs],
                input_names=_tracing.input_names(self.model, len(inputs)),
                model_bytes=len(model_bytes),
                model_tensors=[pb.NamedTensor(name=n, tensor=m) for (n, _), m in zip(
                    apart, bulk.encode_all([t for _, t in apart],
                                           threads=min(8, os.cpu_count() or 1)))])
            if apart:
                logger.debug("pyrannc: wrote %d model tensors to shared memory in %.2f s",
                             len(apart), time.perf_counter() - started)
            self._save_forward = _save_job.save_job(job_spec, model_bytes)
            # An offloaded model's local copy goes now, while the job is created (the daemon's
            # copy and its page-locked masters would otherwise meet it and the shared-memory
            # copy: the host's peak); put back from shared memory if creation fails.
            sources = self._release_local_model(apart, [m.tensor for m in job_spec.model_tensors])

            step = _codec.chunk_bytes(_codec.MODEL_CHUNK_BYTES, conn.info.max_message_bytes)

            def requests():
                yield pb.CreateJobRequest(spec=job_spec)
                for off in range(0, len(model_bytes), step):
                    yield pb.CreateJobRequest(model_chunk=model_bytes[off:off + step])

            try:
                started = time.perf_counter()
                resp = conn.call_streaming_request("CreateJob", requests())
                logger.debug("pyrannc: CreateJob (sending the model, the daemon's import, "
                             "planning and placement) took %.2f s", time.perf_counter() - started)
                self._adopt_job(conn, resp, mode, spec, lease, owner=True)
            except RanncError as err:
                self._restore_local_model(sources)
                if self._deployment_path is not None and err.code in (
                        grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
                    raise RanncError(
                        f"{err}\n(the deployment came from load_deployment="
                        f"{self._deployment_path}; a deployment only fits the model it was "
                        "planned for and devices it still fits on; drop load_deployment to "
                        "plan again)", code=err.code, details=err.details) from None
                raise
            except BaseException:
                self._restore_local_model(sources)
                raise
        # Optimizer state loaded before the first forward (optimizer.load_state_dict) goes to
        # the daemon with the job.
        if self._optimizer is not None and self._optimizer.state:
            self._load_optimizer_state(_optim.local_state_by_name(self._optimizer, names_by_id))
            self._optimizer.state.clear()

    def _release_local_model(self, apart: List[Tuple[str, torch.Tensor]],
                             messages) -> List[Tuple[torch.Tensor, pb.Tensor]]:
        """With offload_params, frees the memory of the local model's tensors that go to the
        daemon beside the archive (`apart`, the large ones, encoded as `messages`): from the job's
        creation on the daemon's copy is the one that trains, and the local one would only double
        the host memory an offloaded job needs. The tensor objects stay (in their module slots,
        and the optimizer's references), empty; the first read of the local model
        (_sync_from_daemon) gives them memory again and fills it from the daemon. Returns each
        freed tensor with its message, for _restore_local_model. The client config key
        keep_local_model turns this off. Empties `apart` (the traced module's tensors, which
        share their memory with the model's) for the memory to go."""
        if (not self._offload_params or not apart
                or _config.client_bool("keep_local_model", False)):
            return []
        by_ptr = {t.data_ptr(): m for (_, t), m in zip(apart, messages)}
        sources = [(s.tensor, by_ptr[s.tensor.data_ptr()]) for s in _tensors.distinct(self.model)
                   if s.tensor.data_ptr() in by_ptr]
        self._released = _tensors.release(t for t, _ in sources)
        apart.clear()
        # The trace's objects hold the old memory in reference cycles (measured: a GPT's whole
        # model stays resident until the collector runs), so collect them now.
        gc.collect()
        logger.debug("pyrannc: freed %d bytes of the local model, which the daemon is given",
                     self._released.nbytes())
        return sources

    def _restore_local_model(self, sources: List[Tuple[torch.Tensor, pb.Tensor]]) -> None:
        """Undoes _release_local_model when the job was not created: each tensor gets its memory
        back, filled from what was sent (shared memory stays until the CreateJob's session
        ends)."""
        if not sources or self._released is None:
            return
        restored = self._released.restore()
        for t, msg in sources:
            if id(t) in restored:
                t.data.copy_(_codec.decode(msg))
        self._released = None

    def _local_shape(self, t: torch.Tensor) -> torch.Size:
        """A local model tensor's shape, also while _release_local_model has emptied it."""
        return self._released.shape_of(t) if self._released is not None else t.shape

    def _reuse_trace(self, conn, rank: int, fingerprint, why_not: str
                     ) -> Optional[Tuple[bytes, object, List[Tuple[str, torch.Tensor]]]]:
        """The saved trace of load_deployment's file, as _trace's first three results with every
        tensor of the model apart, when it is a trace of this model as it is now; else None
        (the caller traces), saying why at INFO level.

        Rank 0 sends all the tensors (small ones inline, the rest through shared memory); ranks
        other than 0 only need the outputs' structure.
        """
        saved = self._loaded_trace
        if saved is None:
            if self._deployment_path is not None:
                logger.info("pyrannc: tracing the model: %s holds no saved trace (written by "
                            "an older pyrannc, `rannc plan`, or from a model without a stable "
                            "fingerprint)", self._deployment_path)
            return None

        def no(why: str) -> None:
            logger.info("pyrannc: tracing the model instead of reusing the trace saved in %s: "
                        "%s", self._deployment_path, why)
            return None

        if not _saved_trace.reuse_enabled():
            return no("the config key reuse_trace (RANNC_REUSE_TRACE) is off")
        if fingerprint is None:
            return no(why_not)
        try:
            why = _saved_trace.mismatch(json.loads(saved.fingerprint), fingerprint)
        except (ValueError, AttributeError) as err:
            why = f"the saved fingerprint is unreadable ({err})"
        if why is not None:
            return no(why)
        try:
            spec = _saved_trace.outputs_from_json(saved.outputs)
        except ValueError as err:
            return no(str(err))
        apart: List[Tuple[str, torch.Tensor]] = []
        if rank == 0:
            apart = _saved_trace.model_tensors(self.model)
            if conn.shm is None:
                # Without shared memory every tensor rides inline in the JobSpec message.
                total = _tensors.distinct_bytes(self.model, 0)
                limit = conn.info.max_message_bytes // 2
                if total > limit:
                    return no(f"without shared memory to the daemon the model's tensors "
                              f"({_deployment.human_bytes(total)}) would go inline in one "
                              f"message, over half the daemon's limit "
                              f"({_deployment.human_bytes(conn.info.max_message_bytes)})")
            elif not _shm.has_room(conn.shm, _tensors.distinct_bytes(self.model, _shm.MIN_BYTES)):
                return no(f"{conn.shm.directory} has too little free space for the model's "
                          "tensors")
        self._saved_trace = saved
        logger.info("pyrannc: reusing the trace saved in %s (the model was not traced)",
                    self._deployment_path)
        return saved.archive, spec, apart

    def _adopt_job(self, conn, resp, mode: pb.Mode, spec, lease: float, owner: bool,
                   address: Optional[str] = None) -> None:
        expected = len(_outputs.leaves(spec))
        if len(resp.outputs) != expected:
            if owner:
                conn.call("DeleteJob", pb.JobRef(job_id=resp.job_id))
            raise RuntimeError(f"ranncd reports {len(resp.outputs)} outputs for the model but "
                               f"the trace returned {expected}")
        group_ids = _optim.group_param_ids(self._optimizer) if self._optimizer else []
        self._job = _jobs.Job(resp.job_id, mode, spec, group_ids, list(resp.devices), owner,
                              address)
        conn.hold_lease(resp.job_id, lease)
        self._job.lease_conn = conn
        self._job.lease = lease
        self._job.name = _jobs.job_name(self.model)
        on_moved = weakref.WeakMethod(self._job_moved)
        _daemon.watch_for_moves(resp.job_id, self._job.name,
                                lambda located: on_moved() and on_moved()(located))
        self._deployment = resp.deployment if resp.HasField("deployment") else None
        self._plan_summary = resp.plan_summary or None
        self._job_token = resp.job_token or None
        self._resumed_step = resp.resumed_step if resp.resumed_step >= 0 else None
        if self._resumed_step is not None:
            self._state_dirty = True  # the local model mirrors the checkpoint's values
            logger.info("pyrannc: job %s resumed from the checkpoint of step %d", resp.job_id,
                        self._resumed_step)
        logger.info("pyrannc: job %s on %s", resp.job_id, ", ".join(resp.devices))

    def _job_moved(self, located: pb.RegisteredJob) -> None:
        """The job's daemon was lost and `located.leader` took it over from its latest
        checkpoint, as `located.job_id`: drive it there from now on (_daemon raises JobMoved)."""
        job = self._job
        if job is None:
            return
        if job.lease_conn is not None:
            job.lease_conn.release_lease(job.id)
        conn = _daemon.connection(located.leader)
        job.id = located.job_id
        job.address = located.leader
        job.devices = list(located.devices)
        # Nothing of the lost daemon's job carries over: its last forward and deferred ops.
        job.forwards = 0
        job.last_forward_id = None
        job.pending = []
        job.graph_released = False
        job.undeployed = False
        conn.hold_lease(job.id, job.lease)
        job.lease_conn = conn
        self._resumed_step = located.resumed_step if located.resumed_step >= 0 else None
        self._state_dirty = True  # the local model mirrors the checkpoint's values now
        on_moved = weakref.WeakMethod(self._job_moved)
        _daemon.watch_for_moves(job.id, job.name,
                                lambda again: on_moved() and on_moved()(again))
        logger.warning("pyrannc: job '%s' moved to ranncd at %s as %s, from the checkpoint of "
                       "step %d", job.name, located.leader, job.id,
                       max(located.resumed_step, 0))

    def _switch_mode(self, inputs, mode: pb.Mode) -> None:
        job = self._job
        conn = self._connection()
        self._flush()
        resp = conn.call("SetMode", pb.SetModeRequest(job_id=job.id, mode=mode))
        key = _jobs.mode_key(mode)
        if not resp.has_graph or key not in job.specs:
            # The daemon reads only the graph of another mode (the job has the tensors), so
            # every tensor stays out of the archive.
            if self._released is not None:
                self._sync_from_daemon()  # tracing runs the local model's forward
            model_bytes, spec, _, _ = _tracing.trace(
                self.model, _tracing.trace_inputs(inputs)[0], mode, apart_bytes=0)
            job.specs[key] = spec
            if not resp.has_graph:
                step = _codec.chunk_bytes(_codec.MODEL_CHUNK_BYTES, conn.info.max_message_bytes)

                def requests():
                    yield pb.AddModeRequest(header=pb.AddModeRequest.Header(
                        job_id=job.id, mode=mode, model_bytes=len(model_bytes)))
                    for off in range(0, len(model_bytes), step):
                        yield pb.AddModeRequest(model_chunk=model_bytes[off:off + step])

                conn.call_streaming_request("AddMode", requests())
        job.mode = mode

    def _forward_rpc(self, inputs, requires_grad: bool):
        job = self._job
        conn = self._connection()
        with _shm.session(conn.shm) as wire:
            req = pb.ForwardRequest(
                job_id=job.id, inputs=[wire.encode(x) for x in inputs],
                requires_grad=requires_grad, before=job.pending,
                client_rank=_runtime.get_rank(),
                delay_grad_allreduce=requires_grad and _runtime.delay_grad_allreduce_flag)
            job.pending = []
            if requires_grad and self._save_forward:
                _save_job.save_forward(req, inputs)
                self._save_forward = False
            region = wire.reply_region()
            if region is not None:
                req.reply_shm.CopyFrom(region)
            resp = conn.call("Forward", req)
            outputs = wire.decode_outputs(resp.outputs)
        job.undeployed = False
        job.forwards += 1
        if job.mode.training:
            self._state_dirty = True  # e.g. BatchNorm running statistics
        # A no-grad forward also replaces the daemon's last forward: older outputs lose their
        # backward either way.
        job.last_forward_id = job.forwards if requires_grad else None
        job.graph_released = False
        return outputs, job.forwards

    def _backward_rpc(self, forward_id: int, grads) -> None:
        job = self._job
        if job is None:
            raise RuntimeError("pyrannc: backward after the job was cleared or undeployed; run "
                               "forward again")
        if forward_id != job.last_forward_id:
            raise RuntimeError(
                "pyrannc: backward through outputs of an earlier forward; ranncd keeps only the "
                "last forward's graph, so call backward before the next forward")
        if job.graph_released:
            details = ("backward called with no forward pending: call forward (with gradients "
                       "enabled) first, or keep_graph(True) to run backward twice over one "
                       "forward")
            raise RanncError(f"ranncd Backward failed: FAILED_PRECONDITION: {details}",
                             code=grpc.StatusCode.FAILED_PRECONDITION, details=details)
        job.graph_released = not _runtime.keep_graph_flag
        conn = self._connection()
        with _shm.session(conn.shm) as wire:
            req = pb.BackwardRequest(job_id=job.id, retain_graph=_runtime.keep_graph_flag,
                                     client_rank=_runtime.get_rank(),
                                     delay_grad_allreduce=_runtime.delay_grad_allreduce_flag)
            for i, g in enumerate(grads):
                if g is not None:
                    req.grads.add(output_index=i, grad=wire.encode(g))
            # Grads placed in shared memory must be read before the region is reused, so only
            # all-inline backwards (a loss's scalar grad, typically) wait for the next forward.
            if _jobs.defer_ops() and not any(g.grad.HasField("shm") for g in req.grads):
                job.pending.append(pb.DeferredOp(backward=req))
                return
            self._flush()
            conn.call("Backward", req)

    def _defer(self, op: pb.DeferredOp) -> None:
        self._job.pending.append(op)
        if not _jobs.defer_ops():
            self._flush()

    def _flush(self) -> None:
        """Sends deferred ops; called before any call that reads or changes daemon state."""
        job = self._job
        if job is not None and job.pending:
            ops, job.pending = job.pending, []
            self._connection().call("Flush", pb.FlushRequest(
                job_id=job.id, ops=ops, client_rank=_runtime.get_rank()))

    # ------------------------------------------------------------------------------------------
    # Optimizer and gradients.

    def _has_job(self) -> bool:
        return self._job is not None

    def _optimizer_step(self) -> None:
        job = self._job
        if job is None:
            return  # no forward yet: no gradients, nothing to update (as in PyTorch)
        opt = self._optimizer
        if _optim.group_param_ids(opt) != job.group_ids:
            raise RuntimeError(
                "pyrannc: the optimizer's param groups changed after the first forward; ranncd "
                "fixed them when the job was created. Create the optimizer with all its groups "
                "before the first forward.")
        kind = _optim.optimizer_type(opt)
        req = pb.StepRequest(job_id=job.id,
                             groups=[_optim.hyper_params(g, kind) for g in opt.param_groups],
                             client_rank=_runtime.get_rank())
        self._defer(pb.DeferredOp(step=req))
        self._state_dirty = True

    def _optimizer_state(self) -> Dict[str, Dict[str, torch.Tensor]]:
        """The daemon's optimizer state: parameter name -> {key: tensor}."""
        self._flush()
        assembler = _codec.StateAssembler()
        for chunk in self._connection().stream("OptimizerState", pb.JobRef(job_id=self._job.id)):
            chunk.name = f"{chunk.name}[{chunk.state_key}]"  # no parameter name holds a '['
            assembler.add(chunk)
        state: Dict[str, Dict[str, torch.Tensor]] = {}
        for joined, (value, _) in assembler.result().items():
            name, key = joined[:-1].rsplit("[", 1)
            state.setdefault(name, {})[key] = value
        return state

    def _load_optimizer_state(self, state: Dict[str, Dict[str, torch.Tensor]]) -> None:
        """Replaces the daemon's optimizer state (parameter name -> {key: tensor})."""
        conn = self._connection()
        job_id = self._job.id
        step = _codec.chunk_bytes(_codec.STREAM_CHUNK_BYTES, conn.info.max_message_bytes)

        def requests(call):
            yield pb.LoadStateDictRequest(header=pb.LoadStateDictRequest.Header(job_id=job_id,
                                                                                call=call))
            for name, entries in state.items():
                for key, value in entries.items():
                    value = torch.as_tensor(value).detach().cpu()
                    for chunk in _codec.state_chunks(name, value, False, step):
                        chunk.state_key = key
                        yield pb.LoadStateDictRequest(chunk=chunk)

        self._flush()
        conn.call_streaming_request("LoadOptimizerState", requests)

    def _zero_grad(self, set_to_none: bool) -> None:
        if self._job is not None:
            self._defer(pb.DeferredOp(zero_grad=pb.ZeroGradRequest(
                job_id=self._job.id, set_to_none=bool(set_to_none),
                client_rank=_runtime.get_rank())))
        self.model.zero_grad(set_to_none=set_to_none)

    def zero_grad(self, set_to_none: bool = _optim.MODULE_SET_TO_NONE_DEFAULT) -> None:
        """Zeroes (or, with set_to_none, drops) the gradients in the daemon."""
        self._zero_grad(set_to_none)

    def clip_grad_norm(self, max_grad_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips all gradients by their total norm, like torch.nn.utils.clip_grad_norm_.

        Returns the total norm before clipping.
        """
        if self._job is None:
            return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm,
                                                  norm_type)
        self._flush()
        resp = self._connection().call("ClipGradNorm", pb.ClipGradNormRequest(
            job_id=self._job.id, max_norm=float(max_grad_norm), norm_type=float(norm_type),
            client_rank=_runtime.get_rank()))
        dtype = next((p.dtype for p in self.model.parameters()), torch.float32)
        return torch.tensor(resp.total_norm, dtype=dtype)

    def allreduce_grads(self) -> None:
        """All-reduces the gradients that backwards under delay_grad_allreduce(True) left on
        each replica, once for all of them; call it before optimizer.step() and
        clip_grad_norm(), which fail until then. With several client ranks every rank calls it.
        """
        if self._job is None:
            return  # no forward yet: no gradients
        self._flush()
        self._connection().call("AllReduceGrads", pb.AllReduceGradsRequest(
            job_id=self._job.id, client_rank=_runtime.get_rank()))

    # ------------------------------------------------------------------------------------------
    # Parameters and state.

    def _local_entry(self, name: str) -> Optional[torch.Tensor]:
        state = self.model.state_dict(keep_vars=True)
        return state.get(name)

    def get_param(self, name: str, amp_master_param: bool = False) -> torch.Tensor:
        """The current value of parameter (or buffer) `name`, which may be any alias."""
        self._check_amp_master(amp_master_param, "get_param")
        if self._job is None:
            t = self._local_entry(name)
            if t is None:
                raise KeyError(f"the model has no parameter or buffer named '{name}'")
            return t.detach().clone()
        self._flush()
        resp = self._connection().call("GetParam", pb.GetParamRequest(
            job_id=self._job.id, name=name, amp_master_param=amp_master_param))
        return _codec.decode(resp.tensor)

    def _check_amp_master(self, asked: bool, what: str) -> None:
        if asked and not self._amp:
            raise ValueError(f"{what}(amp_master_param(s)=True): this module has no mixed-"
                             "precision master parameters; create it with enable_apex_amp=True")

    def get_param_grad(self, name: str, amp_master_param: bool = False) -> Optional[torch.Tensor]:
        """The gradient of parameter `name` (any alias); None when it has none."""
        self._check_amp_master(amp_master_param, "get_param_grad")
        if self._job is None:
            t = self._local_entry(name)
            if t is None:
                raise KeyError(f"the model has no parameter named '{name}'")
            return None if t.grad is None else t.grad.detach().clone()
        self._flush()
        resp = self._connection().call("GetParam", pb.GetParamRequest(
            job_id=self._job.id, name=name, grad=True, amp_master_param=amp_master_param))
        return _codec.decode(resp.tensor) if resp.has_value else None

    def _fetch_state(self) -> Dict[str, Tuple[torch.Tensor, bool]]:
        self._flush()
        assembler = _codec.StateAssembler()
        for chunk in self._connection().stream(
                "StateDict", pb.StateDictRequest(job_id=self._job.id)):
            assembler.add(chunk)
        return assembler.result()

    def _sync_from_daemon(self, force: bool = False, grads: bool = False) -> None:
        """Copies the daemon's parameters and buffers into the local model's tensors in place,
        so references the caller holds (and the optimizer's) see the new values. Tensors that
        _release_local_model freed are allocated again first and always filled."""
        released = self._released
        if self._job is None or not (self._state_dirty or force or grads or released is not None):
            return
        refilled = released.restore() if released is not None else set()
        try:
            remote = self._fetch_state()
            local = self.model.state_dict(keep_vars=True)
            with torch.no_grad():
                for name, tensor in local.items():
                    if not isinstance(tensor, torch.Tensor):
                        continue
                    if name not in remote:
                        # Parameters the traced graph does not use never change in the daemon;
                        # a freed one, though, has no value here until the daemon's fills it.
                        if id(tensor) in refilled:
                            raise RuntimeError(
                                f"ranncd's state lacks '{name}', which it took from the local "
                                "model (offload_params); the local model cannot be restored")
                        continue
                    value, _ = remote[name]
                    if value.shape != tensor.shape:
                        raise RuntimeError(f"ranncd holds '{name}' with shape "
                                           f"{list(value.shape)} but the local model has "
                                           f"{list(tensor.shape)}")
                    tensor.copy_(value)
        except BaseException:
            if released is not None:
                released.free()  # no undefined values pass for the model's
            raise
        self._released = None
        if grads:
            for name, p in self.model.named_parameters():
                g = self.get_param_grad(name)
                p.grad = g
        self._state_dirty = False

    def parameters(self, recurse: bool = True):
        self._sync_from_daemon()
        return self.model.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True, **kwargs):
        self._sync_from_daemon()
        return self.model.named_parameters(prefix, recurse, **kwargs)

    def buffers(self, recurse: bool = True):
        self._sync_from_daemon()
        return self.model.buffers(recurse)

    def named_buffers(self, prefix: str = "", recurse: bool = True, **kwargs):
        self._sync_from_daemon()
        return self.model.named_buffers(prefix, recurse, **kwargs)

    def state_dict(self, *args, rank0_only: bool = True, no_hook: bool = False,
                   sync_grad: bool = False, amp_master_params: bool = True, **kwargs):
        """The full model state (parameters and buffers under every alias), from the daemon,
        with RaNNC's arguments:

        - rank0_only=True: only client rank 0 gets the state; the other ranks of a job driven
          by several client processes get an empty dict (False: every rank gets it).
        - no_hook=True: the model's state_dict hooks (`_register_state_dict_hook`) are not run.
        - amp_master_params=True (the default): with mixed precision, the fp32 master
          parameters; False: the parameters as the forward computes with them (amp_level O2:
          floating parameters cast to amp_dtype; O1: autocast casts per op, so the fp32 ones).
          Without mixed precision both are the parameters.
        - sync_grad=True also copies the daemon's gradients into `.grad`.
        """
        if rank0_only and _runtime.get_rank() != 0:
            return collections.OrderedDict()
        self._sync_from_daemon(grads=sync_grad)
        if no_hook:
            state = _without_state_dict_hooks(self.model, *args, **kwargs)
        else:
            state = self.model.state_dict(*args, **kwargs)
        if not amp_master_params and self._amp:
            dtype = self._amp_forward_dtype()
            if dtype is not None:
                params = {id(p) for p in self.model.parameters()}
                local = self.model.state_dict(keep_vars=True)
                for key, value in state.items():
                    if id(local.get(key)) in params and value.is_floating_point():
                        state[key] = value.to(dtype)
        return state

    def _amp_forward_dtype(self) -> Optional[torch.dtype]:
        """The dtype floating parameters enter the forward in: amp_dtype at amp_level O2, None at
        O1 (autocast casts per op; the parameters stay fp32): the job's, as it was created, or
        the current config before there is one (or for a rank that joined another's)."""
        config = self._job_config if self._job is not None and self._job_config else \
            _config.job_config()
        if config.get("amp_level", "O1").upper() != "O2":
            return None
        return torch.float16 if config.get("amp_dtype", "bf16").lower() in ("fp16", "float16",
                                                                          "half") \
            else torch.bfloat16

    def load_state_dict(self, state_dict, strict: bool = True):
        """Loads parameters and buffers, before the first forward (into the local model) or
        after it (into the daemon). Mis-shaped keys always fail; with strict, so do missing
        and unexpected keys, as in PyTorch."""
        if self._job is None:
            return self.model.load_state_dict(state_dict, strict)
        local = self.model.state_dict(keep_vars=True)
        missing = [k for k in local if k not in state_dict]
        unexpected = [k for k in state_dict if k not in local]
        errors = []
        for k, v in state_dict.items():
            if k in local and isinstance(v, torch.Tensor) and \
                    v.shape != self._local_shape(local[k]):
                errors.append(f"size mismatch for {k}: copying a param with shape "
                              f"{v.shape} from checkpoint, the shape in current model is "
                              f"{self._local_shape(local[k])}.")
        if strict:
            if unexpected:
                errors.insert(0, "Unexpected key(s) in state_dict: "
                              + ", ".join(f'"{k}"' for k in unexpected) + ". ")
            if missing:
                errors.insert(0, "Missing key(s) in state_dict: "
                              + ", ".join(f'"{k}"' for k in missing) + ". ")
        if errors:
            raise RuntimeError("Error(s) in loading state_dict for {}:\n\t{}".format(
                type(self.model).__name__, "\n\t".join(errors)))
        param_ids = {id(p) for p in self.model.parameters()}
        buffer_names = {k for k, v in local.items() if id(v) not in param_ids}
        job_id = self._job.id
        conn = self._connection()
        step = _codec.chunk_bytes(_codec.STREAM_CHUNK_BYTES, conn.info.max_message_bytes)

        def requests(call):
            yield pb.LoadStateDictRequest(header=pb.LoadStateDictRequest.Header(
                job_id=job_id, strict=strict, call=call))
            for name, value in state_dict.items():
                if name in local and isinstance(value, torch.Tensor):
                    value = value.to(local[name].dtype)
                    for chunk in _codec.state_chunks(name, value, name in buffer_names, step):
                        yield pb.LoadStateDictRequest(chunk=chunk)

        self._flush()
        resp = conn.call_streaming_request("LoadStateDict", requests)
        self._state_dirty = True
        return torch.nn.modules.module._IncompatibleKeys(
            sorted(set(missing) | set(resp.missing_keys)),
            sorted(set(unexpected) | set(resp.unexpected_keys)))

    # ------------------------------------------------------------------------------------------
    # Modes and placement.

    def train(self, mode: bool = True):
        """Sets train/eval mode; the daemon switches at the next forward (tracing the model in
        the new mode first if it has no graph for it)."""
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        self.training = mode
        self.model.train(mode)
        return self

    def enable_dropout(self, enable: bool) -> None:
        """Turns dropout on or off independently of train/eval (RaNNC's enable_dropout)."""
        self._dropout = bool(enable)

    def to(self, *args, **kwargs):
        warnings.warn("RaNNCModule.to() is a no-op: ranncd places the model on its devices",
                      stacklevel=2)
        return self

    def cuda(self, *args, **kwargs):
        warnings.warn("RaNNCModule.cuda() is a no-op: ranncd places the model on its devices",
                      stacklevel=2)
        return self

    # ------------------------------------------------------------------------------------------
    # Deployment.

    @property
    def deployment(self):
        """The job's plan (a rannc.v1.Deployment), or None before the first forward."""
        return self._deployment

    @property
    def plan_summary(self) -> Optional[str]:
        """The daemon's description of the plan for people, or None before the first forward."""
        return self._plan_summary

    @property
    def job_token(self) -> Optional[str]:
        """The job's token, which alone (or the admin's) may drive, read, checkpoint or delete
        it: for other processes (RANNC_TOKEN). None before the first forward, and from a daemon
        without tokens (docs/security.md)."""
        return self._job_token

    def save_deployment(self, file) -> None:
        """Writes the job's deployment to `file`, for RaNNCModule(load_deployment=file) and
        pyrannc.show_deployment. The plan is made at the first forward, so call this after it.

        The file also keeps the first forward's trace (graph and code only, no tensor values;
        see pyrannc._saved_trace): a RaNNCModule loading it reuses the trace instead of tracing
        the model again when the model is the same (its module tree, tensor names, shapes and
        dtypes, module class sources and attributes), the inputs have the same signature, the
        mode is the same and so is the torch version, unless RANNC_REUSE_TRACE=0. The values
        always come from the model passed to that RaNNCModule. Code the forward calls outside
        the module classes (a helper function in another file) is not compared: after changing
        only such code, set RANNC_REUSE_TRACE=0 or save the deployment again."""
        if self._deployment is None:
            if self._job is None:
                raise RuntimeError(
                    "save_deployment: there is no deployment yet; RaNNC plans the model at the "
                    "first forward, so call save_deployment after the first forward")
            raise RuntimeError("save_deployment: ranncd returned no deployment for this job "
                               "(a daemon older than the planner?)")
        if self._saved_trace is None:
            logger.info("pyrannc: %s keeps no trace of the model, so a start from it traces "
                        "again: %s", os.fspath(file), self._no_trace_reason)
        _deployment.save_deployment_file(self._deployment, file, self._saved_trace)

    # ------------------------------------------------------------------------------------------
    # Checkpoints (pyrannc._checkpoints).

    def checkpoint(self, wait: bool = True) -> "_checkpoints.CheckpointInfo":
        """Has the daemons write a checkpoint of the job now (config key checkpoint_dir):
        parameters, buffers, optimizer state, step counters, the loss scaler and the RNG. The
        state is copied to host memory at once; with wait=False training goes on while the
        daemons write it (the returned info then says committed=False)."""
        if self._job is None:
            raise RuntimeError("checkpoint: there is no job yet; the daemon's job is made at the "
                               "first forward, so call checkpoint after it")
        self._flush()
        return _checkpoints.save(self._connection(), self._job.id, wait)

    def checkpoints(self) -> List["_checkpoints.CheckpointInfo"]:
        """The job's checkpoints, oldest first (the last may be one its daemons are writing:
        committed=False); before the first forward, those under checkpoint_dir for this job's
        name (RANNC_JOB, else the model's class name)."""
        job_id = None
        if self._job is not None:
            self._flush()  # a deferred step may write one
            job_id = self._job.id
        return _checkpoints.listed(self._connection(), _checkpoints.ref(job_id, self.model))

    def export_checkpoint(self, path, step: int = 0) -> int:
        """Writes checkpoint `step` (0: the newest) as one file plain PyTorch loads:
        torch.load(path) gives {'model': state_dict, 'optimizer': optimizer.state_dict()}.
        Returns the step written."""
        if self._job is not None:
            self._flush()
        ref = _checkpoints.ref(self._job.id if self._job is not None else None, self.model)
        ref.step = step
        return _checkpoints.export(self._connection(), ref, path)

    @property
    def resumed_step(self) -> Optional[int]:
        """The optimizer steps of the checkpoint the job started from (config key resume), or
        None when it started afresh. Before the first forward: the step of the checkpoint that
        resume would start it from now, so a training loop can skip that many batches first."""
        if self._job is not None:
            return self._resumed_step
        return _checkpoints.step_to_resume(self._connection(), self.model)

    def undeploy(self, sync: bool = True) -> None:
        """Copies the daemon's state into the local model and frees the job's device memory.
        The job (with its optimizer state) stays; the next forward deploys it again."""
        if self._job is None:
            return
        self._sync_from_daemon(force=sync)
        self._flush()
        self._connection().call("Undeploy", pb.JobRef(job_id=self._job.id))
        self._job.undeployed = True
        self._job.last_forward_id = None

    def _drop_job(self) -> None:
        """Pulls the state into the local model and deletes the daemon's job; the next forward
        creates a new one (with fresh optimizer state)."""
        if self._job is None:
            return
        try:
            self._sync_from_daemon()
            if self._job.owner:
                self._connection().call("DeleteJob", pb.JobRef(job_id=self._job.id))
        finally:
            self._job = None
            self._state_dirty = False

    def recreate_communicators(self) -> None:
        if self._job is not None:
            self._flush()
            self._connection().call("RecreateCommunicators", pb.JobRef(job_id=self._job.id))

    def __del__(self):
        # A finalizer may run inside any call, gRPC's included, so it only queues the job for
        # deletion; the next job creation deletes it.
        job = self.__dict__.get("_job")
        if job is not None and job.owner:
            _jobs.orphan(job.id)
