export OUT; source .gpu/remote/env.sh; export NCCL_NVLS_ENABLE=0
SYNC_TESTS=cuda_ipc bash experiments/bench/gpu_run.sh sync_tests
SYNC_TRANSPORTS=cuda_ipc bash experiments/bench/gpu_run.sh weight_sync
rm -rf $OUT/prof
