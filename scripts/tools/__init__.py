"""Development tools, not benchmarks: a compile report of the kernels for sm_90 (compile_check), the CLI's
--help time (check_help_speed), a fault and load run against a sidecar (fault_load), a probe of the CPU
facts the batch-invariant mode rests on (probe_invariance), a kernel profile of decode steps
(profile_decode), and the device runner that runs the cuda tests or the benchmarks in one call
(device_check.sh)."""
