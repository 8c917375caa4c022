"""The demo: a simulated product (arithmetic task, simulated users, its evaluation suite and its base
policy) plugged into liverl through the same public interfaces a customer's product uses."""
