"""Wire types shared by every transport and by the server edge: request/response models
(pydantic), log-probabilities, errors mapped to exceptions, and the gRPC protobuf stubs."""
