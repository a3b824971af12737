"""The ops a DP train step may run: an allow list.

`tfdp.models.state_writes` scans every op of the compiled train step (the
per-example forward and backward pass, the loss, compiled metrics'
`update_state`, the optimizer's update, tfdp's counters and anything a
callback changed in the model) and refuses, before the first step, an op
this module does not allow. What is allowed:

- an op that TensorFlow itself defines in one of its computing libraries
  (`_PURE_LIBRARIES`: math, arrays, neural networks, linear algebra,
  stateless random numbers, strings, tensor lists ...) and declares
  stateless: a function of its inputs, with nothing kept or written;
- a stateful op of `STATEFUL`, whose effect stays inside the step or is a
  write to a resource that `state_writes` checks by its target (a model
  weight, an optimizer's or a metric's variable, a seed state);
- tfdp's own compiled ops (`NATIVE`): the noise, keyed by its seed input,
  and an embedding's repeated ids, merged rows and clipped sum;
- outside the per-example pass, the replicas' all-reduce (`COLLECTIVES`).

Everything else is refused: an op that writes out of the step (a file, a
summary, a checkpoint, a print, `DebugIdentityV2` and the other debug-dump
ops, `DatasetToTFRecord`), runs Python (`EagerPyFunc`, `PyFunc`,
`PyFuncStateless`), aborts on values (`Assert`, `CheckNumerics`, `Abort`), reads a
dataset or a queue, calls a function in a layout the scans do not follow
(`For`, `SymbolicGradient`: `CALLS` lists those they do), gates ops by
TensorFlow 1's control flow (`Switch`, `Merge`, `Enter`: a dead output
skips the ops after it by a control edge), or a stateful op tfdp does not
know (a custom op, a stateful random generator), so that an op this list
misses is refused, not released. The list was built from the ops the test suite's models run
(Dense, Conv, Embedding, LSTM/GRU, attention, KerasHub models,
normalization, dropout, augmentation, and every tfdp optimizer's step).

Example:

>>> allowed("MatMul"), allowed("AssignVariableOp"), allowed("DebugIdentityV2")
(True, True, False)
>>> allowed("PyFuncStateless"), allowed("Assert"), allowed("Abort")
(False, False, False)
"""

import tensorflow as tf
from tensorflow.python.framework import op_def_registry

# TensorFlow's computing libraries (tensorflow/python/ops/gen_*_ops): their
# stateless ops are functions of their inputs. Not here: logging (print,
# assert, summaries), io (files, checkpoints), debug, dataset, script
# (Python), data_flow (queues), lookup (tables), state and training (ref
# variables), collective and send/recv ops.
_PURE_LIBRARIES = frozenset({
    "gen_array_ops", "gen_bitwise_ops", "gen_control_flow_ops", "gen_functional_ops",
    "gen_image_ops", "gen_linalg_ops", "gen_list_ops", "gen_manip_ops", "gen_map_ops",
    "gen_math_ops", "gen_nn_ops", "gen_rnn_ops", "gen_special_math_ops",
    "gen_spectral_ops", "gen_stateless_random_ops", "gen_stateless_random_ops_v2",
    "gen_string_ops", "gen_ragged_array_ops", "gen_ragged_conversion_ops",
    "gen_ragged_math_ops", "gen_sparse_ops", "gen_set_ops", "gen_count_ops",
    "gen_ctc_ops", "gen_sparse_csr_matrix_ops", "gen_optional_ops",
    "gen_composite_tensor_ops", "gen_parsing_ops",
})
# Stateless computations of libraries not listed above (data_flow_ops holds
# queues too).
_COMPUTATIONS_ELSEWHERE = frozenset({"DynamicStitch", "ParallelDynamicStitch", "DynamicPartition"})
# Stateless by declaration but not a computation: identities tfdbg (v1)
# watches and dumps, and `Abort`, which ends the process (a bit of the batch
# per step under a condition on it, as an assert would be).
_NEVER = frozenset({"DebugGradientIdentity", "DebugGradientRefIdentity", "Abort"})

# The ops that call functions whose inputs and outputs the scans follow
# (state_writes, released_writes): calls, conds, cases, loops. Others of
# TensorFlow's functional ops lay their inputs out otherwise (`For`'s
# start, limit and delta before its loop variables; `SymbolicGradient`'s
# output gradients after the function's inputs) or run elsewhere
# (`RemoteCall`): refused, as any op that calls a function not listed here.
CALLS = frozenset({"PartitionedCall", "StatefulPartitionedCall", "If", "StatelessIf", "Case",
                   "StatelessCase", "While", "StatelessWhile"})
_OTHER_CALLS = frozenset({"For", "SymbolicGradient", "RemoteCall", "_If", "_While"})
# TensorFlow 1's control flow: a Switch's dead output, passed on by a
# control edge, skips the ops after it, a branch the scans cannot see as
# one (review 24). A tf.function's tf.cond and tf.while_loop build If and
# While instead.
_V1_CONTROL_FLOW = frozenset({
    "Switch", "RefSwitch", "_SwitchN", "Merge", "RefMerge", "Enter", "RefEnter", "Exit",
    "RefExit", "NextIteration", "RefNextIteration", "LoopCond", "ControlTrigger",
})

# Stateful ops whose effect stays in the step, or is a resource write that
# state_writes checks by its target.
STATEFUL = frozenset({
    # Resource variables: handles and reads.
    "VarHandleOp", "ReadVariableOp", "VariableShape", "VarIsInitializedOp",
    "ResourceGather", "ResourceGatherNd", "DestroyResourceOp",
    # Lookup tables (StringLookup, IntegerLookup): reads; an insert is refused.
    "LookupTableFindV2", "LookupTableSizeV2",
    # Resource variables: writes, allowed or refused by the variable written.
    "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
    "ResourceScatterUpdate", "ResourceScatterAdd", "ResourceScatterSub",
    "ResourceScatterMul", "ResourceScatterDiv", "ResourceScatterMin",
    "ResourceScatterMax", "ResourceScatterNdUpdate", "ResourceScatterNdAdd",
    "ResourceScatterNdSub", "ResourceScatterNdMin", "ResourceScatterNdMax",
    "ResourceStridedSliceAssign",
    # Calls and control flow: the functions they call are scanned in turn.
    "StatefulPartitionedCall", "If", "While", "Case",
    # TensorArrays and stacks made inside the step (graph mode v1 forms).
    "TensorArrayV3", "TensorArrayReadV3", "TensorArrayWriteV3", "TensorArrayGatherV3",
    "TensorArrayScatterV3", "TensorArrayConcatV3", "TensorArraySplitV3",
    "TensorArraySizeV3", "TensorArrayCloseV3", "TensorArrayGradV3",
    "StackV2", "StackPushV2", "StackPopV2", "StackCloseV2",
})


# tfdp's own compiled ops, functions of their inputs: the noise
# (tfdp/mechanisms/native/gaussian_noise.cc: Gaussian draws keyed by their
# seed input) and an embedding's repeated ids, merged rows and clipped sum
# (embedding_rows.cc: tfdp's first positions and merge and TensorFlow's
# scatter_nd, bit for bit).
NATIVE = frozenset({"TfdpGaussianNoise", "TfdpGaussianNoiseAdd", "TfdpGaussianNoiseAddGroup",
                    "TfdpFirstPositions", "TfdpMergeRows", "TfdpScatterRows"})


# Replicas' all-reduce (tf.distribute): allowed in the step's own code (the
# sum of noisy gradients, logs), refused in the per-example pass, where it
# would mix examples across replicas.
COLLECTIVES = frozenset({
    "CollectiveReduce", "CollectiveReduceV2", "CollectiveReduceV3", "CollectiveGather",
    "CollectiveGatherV2", "CollectiveAllToAllV2", "CollectiveAllToAllV3",
    "CollectiveBcastSend", "CollectiveBcastRecv", "CollectiveBcastSendV2",
    "CollectiveBcastRecvV2", "CollectiveAssignGroupV2", "CollectiveInitializeCommunicator",
    "NcclAllReduce", "NcclReduce", "NcclBroadcast",
})


def allowed(op_type):
    """Whether an op of this type may run in a DP train step.

    Args:
        op_type: the op's type, e.g. "MatMul" (`tf.Operation.type`).

    Returns:
        True for a stateless op of TensorFlow's computing libraries, an op
        of `STATEFUL` or one of tfdp's compiled ops (`NATIVE`); False
        for anything else.
    """
    if op_type in STATEFUL or op_type in NATIVE:
        return True
    if op_type in _NEVER or op_type in _OTHER_CALLS or op_type in _V1_CONTROL_FLOW:
        return False
    return op_type in _COMPUTATIONS_ELSEWHERE or op_type in _stateless_computations()


_COMPUTATIONS = []


def _stateless_computations():
    """Types of the stateless ops TensorFlow's computing libraries define."""
    if not _COMPUTATIONS:
        found = set()
        for name in dir(tf.raw_ops):
            library = getattr(getattr(tf.raw_ops, name), "__module__", "").rsplit(".", 1)[-1]
            definition = op_def_registry.get(name)
            if library in _PURE_LIBRARIES and definition is not None and not definition.is_stateful:
                found.add(name)
        _COMPUTATIONS.append(frozenset(found))
    return _COMPUTATIONS[0]
