//! kvant-engine
