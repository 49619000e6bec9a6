"""Moving KV blocks between engines (prefill/decode disaggregation): block export/import and
int8 packing, the wire protocol, sender and receiver threads, the Redis store, and the
coordination the EngineCore runs between steps."""
