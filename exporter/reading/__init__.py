"""The daemon's reading: NVML, the GPU backends, the sampler and the collectors."""
