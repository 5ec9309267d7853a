package main

// runReplay is replaced by the replay verb when it is built.
var runReplay = notBuilt("replay")
