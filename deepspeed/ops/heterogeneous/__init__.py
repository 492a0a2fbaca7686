# SPDX-License-Identifier: Apache-2.0
# Home of the prebuilt native op (deepspeed.ops.heterogeneous.heterogeneous_op); load it through
# deepspeed.runtime.heterogeneous.measure.native, which JIT-builds it when it was not prebuilt.
