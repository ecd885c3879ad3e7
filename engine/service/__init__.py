"""The engine as a service: the engine process the daemon supervises (`process`) and the telemetry that
turns host-side engine state into state events (`telemetry`)."""
