//! The main loop's rules against a scripted homeserver (see tests/platforms_matrix.rs for
//! the same against a real Synapse).
