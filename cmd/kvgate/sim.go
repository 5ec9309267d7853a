package main

// runSim is replaced by the sim verb when it is built.
var runSim = notBuilt("sim")
