"""Wire formats: .proto files under proto/pdcluster/v1 and the Python stubs generated from them."""
