// The head start of GPU-only timing (src/timing.rs): one thread holds the stream for `ns`
// nanoseconds of the GPU's global timer. One launch buys any length of head start for a few
// microseconds of host time; a head start made of many short fills cost the host nearly as much
// to queue as it kept the GPU busy, so it ran out before the sample was queued.

extern "C" __global__ void timing_spin_ns(u64 ns) {
    u64 start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
