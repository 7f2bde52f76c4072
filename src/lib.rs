//! eos-bridge: an exactly-once Kafka bridge.
