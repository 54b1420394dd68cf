// inference_server built as CUDA: the same program, whose model is a kernel (see inference_server.cpp).
#include "inference_server.cpp"
