"""From a schedule to forwards: batch views and the one row-count rule (`forward_batch`), runners and
their explicit step bindings (`runner`), and the target-only worker that builds batches and samples."""
