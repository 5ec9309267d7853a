package main

// runBench is replaced by the bench verb when it is built.
var runBench = notBuilt("bench")
