//! mockall mocks and a deterministic simulated RDMA CM fabric implementing the cm-core traits, with the conformance suite.
