"""Request life and scheduling: `Engine` (the offline API and the loop the engine process drives),
`Scheduler` (continuous batching, chunked prefill, admission, preemption, stop conditions) and `Req`."""
