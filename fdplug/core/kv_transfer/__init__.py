"""Moving KV blocks between instances (prefill/decode disaggregation): the pull data path (`pull`)."""
