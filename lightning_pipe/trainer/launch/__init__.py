"""The processes: started, given their process group, restarted by torchrun, stopped by a signal, and a failed rank
told from a lost one."""
