// Compiled with -std=c++14 by the test headers.cxx14_refused: gpukit must stop with its own #error, which says what
// to do, before the compiler's errors about C++17 features.
#include <gpukit/gpukit.hpp>

int main() { return 0; }
