//! The notify pump and event loop: verbs async events (COMM_EST) forwarded to the RDMA CM automatically, exactly one ESTABLISHED per connection.
