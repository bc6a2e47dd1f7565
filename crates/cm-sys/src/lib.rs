//! Safe RAII owners over librdmacm and libibverbs (through rdma-sys) implementing the cm-core traits.
