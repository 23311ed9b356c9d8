//! OCI hooks run by runc for Baton (issue E): placeholder crate so the layout is fixed; it has no behaviour yet.
