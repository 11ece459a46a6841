from compress.models.architectures import PhotoResNet
def r10_w32(num_classes, in_channels): return PhotoResNet(in_channels, num_classes, (1,1,1,1), 32)
def r18_w32(num_classes, in_channels): return PhotoResNet(in_channels, num_classes, (2,2,2,2), 32)
def r10_w48(num_classes, in_channels): return PhotoResNet(in_channels, num_classes, (1,1,1,1), 48)
def r10_w64(num_classes, in_channels): return PhotoResNet(in_channels, num_classes, (1,1,1,1), 64)
def r14_w32(num_classes, in_channels): return PhotoResNet(in_channels, num_classes, (1,2,2,1), 32)
def r18_w48(num_classes, in_channels): return PhotoResNet(in_channels, num_classes, (2,2,2,2), 48)
